"""Wiring of a worker: the front process (gRPC server, tokenization, streams, metrics, placement
follower) and its engine-core process (engine_core.py), which owns the device."""

from __future__ import annotations

import asyncio
import logging
import socket
import time
from dataclasses import dataclass
from pathlib import Path

from services.common.hop_auth import GatewayOnlyInterceptor
from services.common.identity import config_digest
from services.common.metrics import metrics_host, serve_metrics
from services.common.server import (
    bound_address,
    drain_and_stop,
    install_stop_handlers,
    quiet_grpc_poller_wakeups,
    start_server,
)
from services.worker import core_protocol as m
from services.worker.adapters import AdapterManager
from services.worker.core_client import CoreClient
from services.worker.debug_hooks import slow_versions_from_env, step_delay_from_env
from services.worker.disk_cache import DiskCache
from services.worker.metrics import WorkerMetrics
from services.worker.mux import PUMP_BUDGET_S
from services.worker.placement_client import PlacementClient, WorkerIdentity
from services.worker.servicer import WorkerServicer
from services.worker.startup import StartupReport, compile_cache_root
from services.worker.vllm_metrics import VllmCollector, pinned_names, server_shape
from slora.v1 import inference_pb2, inference_pb2_grpc
from slora_core.config import EngineConfig, ModelConfig
from slora_core.startup_profile import process_start_time
from slora_core.tokenizer import Tokenizer

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
    compile_cache_dir: Path | None = None  # compiled kernels; None: <cache_dir>/.compiled
    # CUDA graphs captured while the worker already serves (eagerly where one is missing);
    # False: all of them before it reports ready.
    graphs_in_background: bool = False
    # A GenerateMux writer's time a frame (services/worker/mux.py PUMP_BUDGET_S; 0: a step's
    # every stream in one frame).
    mux_pump_s: float = PUMP_BUDGET_S


def advertised_address(listen: str, port: int) -> str:
    """`listen` with the bound port; a wildcard host becomes this machine's host name."""
    address = bound_address(listen, port)
    host = address.rsplit(":", 1)[0]
    if host in ("", "0.0.0.0", "[::]"):
        return f"{socket.gethostname()}:{port}"
    return address


# The exit code of a worker whose engine core died: its supervisor (`slora up`, compose,
# Kubernetes) restarts it.
EXIT_ENGINE_CORE_DIED = 3


def publish_state(metrics: WorkerMetrics, out: m.StepOutput) -> None:
    st = out.state
    metrics.set_engine_state(running=st.running, waiting=st.waiting, kv_pages=st.kv_pages,
                             adapter_pages=st.adapter_pages, free_pages=st.free_pages,
                             loads=st.adapter_loads, evictions=st.adapter_evictions,
                             merges=st.adapter_merges, merged_steps=st.merged_steps,
                             prefix_queries=st.prefix_cache_queries,
                             prefix_hits=st.prefix_cache_hits)
    for counter, total in ((metrics.admission_waits, st.admission_waits),
                           (metrics.admission_wait_seconds, st.admission_wait_s),
                           (metrics.admission_taken, st.admission_taken),
                           (metrics.admission_paced_steps, st.admission_paced_steps),
                           (metrics.admission_gpu_idle, st.admission_gpu_idle_s)):
        metrics.advance(counter, total)


async def serve_worker(opts: WorkerOptions) -> int:
    """Run a worker until SIGTERM/SIGINT, then drain: health NOT_SERVING, refuse new requests,
    finish running ones (at most `drain_grace_s`), exit 0. If the engine core dies: in-flight
    streams end UNAVAILABLE, health turns NOT_SERVING and the worker exits non-zero."""
    quiet_grpc_poller_wakeups()
    metrics = WorkerMetrics()
    startup = StartupReport(metrics.registry, process_start_time() or time.time())
    stop = asyncio.Event()
    died: list[str] = []

    def on_death(why: str) -> None:
        died.append(why)
        stop.set()

    core = CoreClient(opts.model_dir, opts.engine, on_death=on_death,
                      on_step=lambda out: publish_state(metrics, out),
                      on_started=metrics.queue_time.observe, step_delay_s=step_delay_from_env(),
                      compile_cache_dir=compile_cache_root(opts.cache_dir, opts.compile_cache_dir),
                      on_startup=startup.update, graphs_in_background=opts.graphs_in_background)
    tokenizer = await asyncio.to_thread(Tokenizer.from_dir, opts.model_dir)
    startup.phase_done("process", startup.started)
    await core.start()  # loads the model, compiles kernels, serves a warm-up request
    server_since = time.time()
    if opts.metrics_port is not None:
        port = serve_metrics(opts.metrics_port, metrics.registry, metrics_host(opts.listen))
        log.info("metrics on :%d/metrics", port)
    adapters = AdapterManager(core, DiskCache(opts.cache_dir), metrics)
    model_config = ModelConfig.from_hf_dir(opts.model_dir)
    vocab_size = model_config.vocab_size
    # vLLM's router-facing gauges (llm-d / Inference Extension endpoint pickers scrape them)
    metrics.add_vllm_gauges(VllmCollector(server_shape(opts.engine, model_config),
                                          lambda: core.state, lambda: pinned_names(adapters)))
    servicer = WorkerServicer(opts.worker_id, core, tokenizer, adapters, metrics,
                              slow_versions=slow_versions_from_env(), vocab_size=vocab_size,
                              mux_pump_s=opts.mux_pump_s)
    handle = await start_server(
        opts.listen, lambda s: inference_pb2_grpc.add_InferenceServiceServicer_to_server(servicer, s),
        [SERVICE], interceptors=GatewayOnlyInterceptor.from_env())  # gateways only (hop_auth)
    address = opts.advertise or advertised_address(opts.listen, handle.port)
    identity = WorkerIdentity(opts.worker_id, address, opts.capacity, opts.model_dir.name,
                              config_digest(opts.model_dir))
    placement = PlacementClient(opts.control_plane, identity, adapters, core, metrics,
                                is_draining=lambda: servicer.draining,
                                cluster_token=opts.cluster_token)
    watch = asyncio.create_task(placement.run())
    install_stop_handlers(stop.set)
    assert core.ready is not None
    startup.ready(core.ready, server_since)
    log.info("worker %s serving %s on %s (engine core pid %s)", opts.worker_id,
             opts.model_dir, address, core.pid)
    await stop.wait()
    if died:
        log.error("worker %s: %s; exiting", opts.worker_id, died[0])
        servicer.begin_drain()
        await handle.set_serving(False)
        watch.cancel()
        # The failed streams have their UNAVAILABLE already; give them a moment to go out.
        await handle.server.stop(grace=0.5)
        await core.close()
        return EXIT_ENGINE_CORE_DIED
    log.info("worker %s draining (%d in flight)", opts.worker_id, servicer.inflight)
    servicer.begin_drain()
    await drain_and_stop(handle, servicer.wait_idle, opts.drain_grace_s)
    watch.cancel()
    await core.close()
    return 0
