"""The control plane's rules as plain values: version lifecycle, canary policy and verdict,
per-version evidence, the placement planner, adapter validation. No database, no gRPC."""
