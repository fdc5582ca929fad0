"""Data-plane identities: what a worker presents to the control plane.

A worker's credential (minted per worker id, see services/control_plane/worker_credentials.py)
comes from $SLORA_WORKER_CREDENTIAL; the placement stream presents it instead of the shared
cluster token, which alone no longer makes a process a worker. docs/security.md has the model.
"""

from __future__ import annotations

import os
from collections.abc import Mapping

from services.common.cluster_token import cluster_metadata

WORKER_CREDENTIAL_ENV = "SLORA_WORKER_CREDENTIAL"


def worker_metadata(cluster_token: str = "",
                    env: Mapping[str, str] = os.environ) -> tuple[tuple[str, str], ...]:
    """Metadata for the worker's placement stream: its own credential when it has one, else
    the cluster token (accepted only by control planes in the legacy cluster-token mode)."""
    return cluster_metadata(env.get(WORKER_CREDENTIAL_ENV, "") or cluster_token)
