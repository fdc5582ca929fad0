"""`slora worker`: serve one engine over gRPC, following the control plane's placement."""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import socket
import tempfile
from pathlib import Path

from services.common.cluster_token import add_cluster_token_argument
from services.common.identity import CredentialFileError, worker_credential
from services.worker.mux import PUMP_BUDGET_S
from slora_core.engine_args import add_engine_args


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("worker", help="serve InferenceService.Generate over one engine")
    p.add_argument("--model", required=True, help="Hugging Face model directory")
    p.add_argument("--control-plane", default="",
                   help="control plane host:port (required unless --warm-cache-only)")
    p.add_argument("--listen", default="0.0.0.0:50061", help="host:port to serve on")
    p.add_argument("--advertise", default="", help="host:port gateways use (default: from --listen)")
    p.add_argument("--worker-id", default="", help="default: hostname-port")
    add_cluster_token_argument(p, "presented to the control plane on the placement stream")
    p.add_argument("--metrics-port", type=int, default=None, help="Prometheus HTTP port")
    add_engine_args(p)
    p.add_argument("--capacity", type=int, default=0, help="adapter versions to keep warm")
    p.add_argument("--cache-dir", default="", help="disk cache of adapters (default: temp dir)")
    p.add_argument("--compile-cache-dir", default=os.environ.get("SLORA_COMPILE_CACHE_DIR", ""),
                   help="compiled-kernel cache, one folder per GPU/driver/Triton/kernel-source "
                        "key [SLORA_COMPILE_CACHE_DIR; default: CACHE_DIR/.compiled]")
    # Off by default: its only H200 run (the service-path bench at dec1ba1) had a 7B worker
    # fail to answer its first one-token request within 30 s while capturing, and it has not
    # been timed yet (docs/worker_startup.md).
    p.add_argument("--graphs-in-background", dest="graphs_in_background", action="store_true",
                   help="report ready after the warm-up request and capture CUDA graphs between "
                        "steps, serving eagerly where a graph is not captured yet (default: "
                        "capture every graph before reporting ready)")
    p.add_argument("--graphs-before-ready", dest="graphs_in_background", action="store_false",
                   help="capture every CUDA graph before reporting ready (the default)")
    p.add_argument("--warm-cache-only", action="store_true",
                   help="fill the compiled-kernel cache (load, compile, capture), then exit")
    p.add_argument("--mux-pump-ms", type=float, default=PUMP_BUDGET_S * 1e3,
                   help="a gateway mux's writer pumps streams for about this long before it "
                        "writes a frame, so a new request waits at most that for the front's "
                        "loop (0: a step's every stream in one frame; default: %(default)s)")
    p.add_argument("--drain-grace", type=float, default=30.0, help="seconds to finish on SIGTERM")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from services.worker.main import WorkerOptions, serve_worker
    from slora_core.engine_args import engine_config_from_args

    logging.basicConfig(level=os.environ.get("SLORA_LOG_LEVEL", "INFO"),
                        format="%(asctime)s worker %(levelname)s %(name)s: %(message)s")
    try:  # a named credential file that is missing or empty stops the worker before loading
        worker_credential()
    except CredentialFileError as e:
        raise SystemExit(f"worker: {e}") from None
    engine = engine_config_from_args(args)
    if not 0 <= args.mux_pump_ms <= 1000:
        raise SystemExit(f"worker: --mux-pump-ms must be in [0, 1000], got {args.mux_pump_ms}")
    if not args.warm_cache_only and not args.control_plane:
        raise SystemExit("worker: --control-plane is required")
    port = args.listen.rsplit(":", 1)[-1]
    worker_id = args.worker_id or f"{socket.gethostname()}-{port}"
    cache = Path(args.cache_dir or Path(tempfile.gettempdir()) / f"slora-cache-{worker_id}")
    compile_cache = Path(args.compile_cache_dir) if args.compile_cache_dir else None
    if args.warm_cache_only:
        from services.worker.startup import compile_cache_root, warm_cache_only

        return warm_cache_only(Path(args.model), engine, compile_cache_root(cache, compile_cache))
    opts = WorkerOptions(
        model_dir=Path(args.model), control_plane=args.control_plane, listen=args.listen,
        worker_id=worker_id, engine=engine, cache_dir=cache, advertise=args.advertise,
        metrics_port=args.metrics_port, capacity=args.capacity, drain_grace_s=args.drain_grace,
        cluster_token=args.cluster_token, compile_cache_dir=compile_cache,
        graphs_in_background=args.graphs_in_background,
        mux_pump_s=args.mux_pump_ms / 1e3,
    )
    return asyncio.run(serve_worker(opts))
