"""`slora gateway`: the data-plane router in front of the workers."""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import socket
from typing import TYPE_CHECKING

from services.common.cluster_token import add_cluster_token_argument

if TYPE_CHECKING:
    from services.gateway.main import GatewayOptions

PROCESSES_ENV = "SLORA_GATEWAY_PROCESSES"
UPSTREAM_ENV = "SLORA_GATEWAY_UPSTREAM"
UPSTREAMS = ("mux", "call", "auto")
UPSTREAM_DEFAULT = "auto"
MUX_FROM_ENV = "SLORA_GATEWAY_MUX_FROM"
# --upstream auto (the default): streams in flight on a worker (per gateway process) from which
# requests go over the mux. On an H100 host at 256 streams (4 gateway processes: 64 each) it
# cut gRPC TTFT added from 195 to 35 ms p50 (docs/performance.md, "The gateway's upstream:
# auto by default"). At 64 streams (~16 each) with the worker's 1 ms late-admission lead the
# mux added 1.3 ms p50 against 5.5 per call (3 repeats, f02af64; it was 32 until then, and
# per call won there with the lead off: "The mux at 64 streams with the lead"); 8 takes that
# level over the mux however the streams fall across the processes.
MUX_FROM_DEFAULT = 8


def positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be 1 or more, got {value}")
    return value


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("gateway", help="authenticate, route and forward Generate calls")
    p.add_argument("--control-plane", required=True, help="control plane host:port")
    p.add_argument("--listen", default="0.0.0.0:50071", help="host:port to serve gRPC on")
    p.add_argument("--http-listen", default="",
                   help="host:port of the OpenAI-compatible HTTP API, e.g. 0.0.0.0:8000 "
                        "(default: off)")
    p.add_argument("--base-model-name", default="base",
                   help="the HTTP `model` that names the base model without an adapter")
    p.add_argument("--gateway-id", default="", help="default: hostname-port")
    add_cluster_token_argument(p, "presented to the control plane on the routing stream")
    p.add_argument("--metrics-port", type=int, default=None,
                   help="Prometheus HTTP port (with N processes: one port each, PORT..PORT+N-1)")
    p.add_argument("--processes", type=positive_int,
                   default=positive_int(os.environ.get(PROCESSES_ENV, "1")),
                   help="gateway processes sharing the gRPC and HTTP ports (SO_REUSEPORT), "
                        f"each with its own routing stream and metrics; env {PROCESSES_ENV}")
    p.add_argument("--upstream", choices=UPSTREAMS,
                   default=os.environ.get(UPSTREAM_ENV, UPSTREAM_DEFAULT),
                   help="how worker calls travel: call (one Generate call per request), mux "
                        "(one GenerateMux stream per worker) or auto (per call until "
                        "--mux-from streams are in flight on the worker, then the mux; "
                        f"default); env {UPSTREAM_ENV}")
    p.add_argument("--mux-from", type=positive_int,
                   default=positive_int(os.environ.get(MUX_FROM_ENV, str(MUX_FROM_DEFAULT))),
                   help="with --upstream auto: this process's streams in flight on a worker "
                        f"from which its requests go over the mux; env {MUX_FROM_ENV}")
    p.add_argument("--drain-grace", type=float, default=30.0, help="seconds to finish on SIGTERM")
    p.set_defaults(func=run)


def gateway_options(args: argparse.Namespace) -> GatewayOptions:
    from services.gateway.main import GatewayOptions

    port = args.listen.rsplit(":", 1)[-1]
    return GatewayOptions(
        control_plane=args.control_plane, listen=args.listen,
        gateway_id=args.gateway_id or f"{socket.gethostname()}-{port}",
        metrics_port=args.metrics_port, drain_grace_s=args.drain_grace,
        cluster_token=args.cluster_token, http_listen=args.http_listen,
        base_model_name=args.base_model_name,
        upstream_mux_from={"call": None, "mux": 0}.get(args.upstream, args.mux_from),
    )


def run(args: argparse.Namespace) -> int:
    from services.gateway.main import serve_gateway
    from services.gateway.supervisor import serve_processes

    logging.basicConfig(level=os.environ.get("SLORA_LOG_LEVEL", "INFO"),
                        format="%(asctime)s gateway %(levelname)s %(name)s: %(message)s")
    opts = gateway_options(args)
    if args.processes > 1:
        return serve_processes(opts, args.processes)
    return asyncio.run(serve_gateway(opts))
