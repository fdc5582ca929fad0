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


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("worker", help="serve InferenceService.Generate over one engine")
    p.add_argument("--model", required=True, help="Hugging Face model directory")
    p.add_argument("--control-plane", required=True, help="control plane host:port")
    p.add_argument("--listen", default="0.0.0.0:50061", help="host:port to serve on")
    p.add_argument("--advertise", default="", help="host:port gateways use (default: from --listen)")
    p.add_argument("--worker-id", default="", help="default: hostname-port")
    add_cluster_token_argument(p, "presented to the control plane on the placement stream")
    p.add_argument("--metrics-port", type=int, default=None, help="Prometheus HTTP port")
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--num-pages", type=int, default=256)
    p.add_argument("--block-size", type=int, default=None)
    p.add_argument("--max-rank", type=int, default=64)
    p.add_argument("--max-num-seqs", type=int, default=64)
    p.add_argument("--max-num-batched-tokens", type=int, default=512)
    p.add_argument("--max-model-len", type=int, default=None,
                   help="longest prompt + output (default: the model's context length)")
    p.add_argument("--max-adapters-per-batch", type=int, default=64,
                   help="distinct adapters one step may read (default: as many as sequences)")
    p.add_argument("--max-queue", type=int, default=256,
                   help="waiting requests past which new ones get RESOURCE_EXHAUSTED")
    p.add_argument("--async-steps", action="store_true",
                   help="launch each step before reading the previous one's tokens (overlaps "
                        "host work with the GPU; not yet measured on one)")
    p.add_argument("--capacity", type=int, default=0, help="adapter versions to keep warm")
    p.add_argument("--cache-dir", default="", help="disk cache of adapters (default: temp dir)")
    p.add_argument("--drain-grace", type=float, default=30.0, help="seconds to finish on SIGTERM")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from services.worker.main import WorkerOptions, serve_worker
    from slora_core.config import EngineConfig

    logging.basicConfig(level=os.environ.get("SLORA_LOG_LEVEL", "INFO"),
                        format="%(asctime)s worker %(levelname)s %(name)s: %(message)s")
    engine = EngineConfig(
        dtype=args.dtype, device=args.device, num_pages=args.num_pages,
        block_size=args.block_size, max_rank=args.max_rank, max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens, max_model_len=args.max_model_len,
        max_adapters_per_batch=args.max_adapters_per_batch, max_queue=args.max_queue,
        async_steps=args.async_steps,
    )
    port = args.listen.rsplit(":", 1)[-1]
    worker_id = args.worker_id or f"{socket.gethostname()}-{port}"
    cache = Path(args.cache_dir or Path(tempfile.gettempdir()) / f"slora-cache-{worker_id}")
    opts = WorkerOptions(
        model_dir=Path(args.model), control_plane=args.control_plane, listen=args.listen,
        worker_id=worker_id, engine=engine, cache_dir=cache, advertise=args.advertise,
        metrics_port=args.metrics_port, capacity=args.capacity, drain_grace_s=args.drain_grace,
        cluster_token=args.cluster_token,
    )
    return asyncio.run(serve_worker(opts))
