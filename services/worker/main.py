"""Wiring of a worker process: engine thread, gRPC server, metrics, placement, drain."""

from __future__ import annotations

import asyncio
import logging
import os
import socket
import sys
from dataclasses import dataclass
from pathlib import Path

from services.common.metrics import serve_metrics
from services.common.server import (
    bound_address,
    drain_and_stop,
    install_stop_handlers,
    start_server,
)
from services.worker.adapters import AdapterManager
from services.worker.debug_hooks import slow_versions_from_env
from services.worker.disk_cache import DiskCache
from services.worker.engine_loop import EngineLoop
from services.worker.metrics import WorkerMetrics
from services.worker.placement_client import PlacementClient, WorkerIdentity
from services.worker.servicer import WorkerServicer
from slora.v1 import inference_pb2, inference_pb2_grpc
from slora_core.config import EngineConfig
from slora_core.engine import LLMEngine

log = logging.getLogger(__name__)
SERVICE = inference_pb2.DESCRIPTOR.services_by_name["InferenceService"].full_name


@dataclass(frozen=True)
class WorkerOptions:
    model_dir: Path
    control_plane: str
    listen: str
    worker_id: str
    engine: EngineConfig
    cache_dir: Path
    advertise: str = ""        # the address gateways call; default: derived from `listen`
    metrics_port: int | None = None
    capacity: int = 0          # versions to keep warm; 0 = planner default
    drain_grace_s: float = 30.0
    cluster_token: str = ""    # presented on the placement stream (SLORA_CLUSTER_TOKEN)


def advertised_address(listen: str, port: int) -> str:
    """`listen` with the bound port; a wildcard host becomes this machine's host name."""
    address = bound_address(listen, port)
    host = address.rsplit(":", 1)[0]
    if host in ("", "0.0.0.0", "[::]"):
        return f"{socket.gethostname()}:{port}"
    return address


# The engine thread and the asyncio (gRPC) thread share the GIL. When the engine thread comes
# back from waiting on the GPU, Python's default 5 ms switch interval can leave it waiting that
# long for the GIL while the loop streams tokens: a delayed step per step. 0.5 ms hands it over
# sooner. SLORA_GIL_SWITCH_INTERVAL_S overrides it (benchmarks compare settings).
GIL_SWITCH_INTERVAL_S = 0.0005


async def serve_worker(opts: WorkerOptions) -> int:
    """Run a worker until SIGTERM/SIGINT, then drain: health NOT_SERVING, refuse new requests,
    finish running ones (at most `drain_grace_s`), exit 0."""
    sys.setswitchinterval(float(os.environ.get("SLORA_GIL_SWITCH_INTERVAL_S",
                                               GIL_SWITCH_INTERVAL_S)))
    engine = await asyncio.to_thread(LLMEngine.from_model_dir, opts.model_dir, opts.engine)
    # CUDA: compile kernels and capture every decode graph before the first request (no-op on CPU).
    await asyncio.to_thread(engine.warmup, True)
    metrics = WorkerMetrics()
    if opts.metrics_port is not None:
        port = serve_metrics(opts.metrics_port, metrics.registry)
        log.info("metrics on :%d/metrics", port)
    engine_loop = EngineLoop(engine, metrics)
    engine_loop.start()
    adapters = AdapterManager(engine_loop, DiskCache(opts.cache_dir))
    servicer = WorkerServicer(opts.worker_id, engine_loop, adapters, metrics,
                              slow_versions=slow_versions_from_env())
    handle = await start_server(
        opts.listen, lambda s: inference_pb2_grpc.add_InferenceServiceServicer_to_server(servicer, s),
        [SERVICE])
    address = opts.advertise or advertised_address(opts.listen, handle.port)
    identity = WorkerIdentity(opts.worker_id, address, opts.capacity, opts.model_dir.name)
    placement = PlacementClient(opts.control_plane, identity, adapters, engine_loop, metrics,
                                is_draining=lambda: servicer.draining,
                                cluster_token=opts.cluster_token)
    watch = asyncio.create_task(placement.run())
    stop = asyncio.Event()
    install_stop_handlers(stop.set)
    log.info("worker %s serving %s on %s", opts.worker_id, opts.model_dir, address)
    await stop.wait()
    log.info("worker %s draining (%d in flight)", opts.worker_id, servicer.inflight)
    servicer.begin_drain()
    await drain_and_stop(handle, servicer.wait_idle, opts.drain_grace_s)
    watch.cancel()
    engine_loop.stop()
    return 0
