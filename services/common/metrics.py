"""The Prometheus HTTP endpoint shared by the services."""

from __future__ import annotations

import os
from collections.abc import Mapping

from prometheus_client import CollectorRegistry, start_http_server

METRICS_HOST_ENV = "SLORA_METRICS_HOST"

# Latency buckets (seconds) for token-level timings on CPU and GPU alike.
LATENCY_BUCKETS: tuple[float, ...] = (
    0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0,
)


def metrics_host(listen: str, env: Mapping[str, str] = os.environ) -> str:
    """Where a process's Prometheus (and other side) endpoints bind: $SLORA_METRICS_HOST, else
    the host of its gRPC `listen` address, so a process on loopback exposes nothing more."""
    host = env.get(METRICS_HOST_ENV) or listen.rsplit(":", 1)[0]
    return host.strip("[]") or "0.0.0.0"


def serve_metrics(port: int, registry: CollectorRegistry, addr: str = "0.0.0.0") -> int:
    """Serve `registry` at http://addr:port/metrics from a daemon thread; returns the bound
    port (pass 0 to pick a free one)."""
    httpd, _thread = start_http_server(port, addr=addr, registry=registry)
    return int(httpd.server_port)
