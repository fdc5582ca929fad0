"""The control plane: SQL adapter registry, admin API, auth (DESIGN sections 1, 2 and 4)."""
