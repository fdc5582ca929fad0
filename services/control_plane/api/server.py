"""Assembling and running the control-plane gRPC server (admin API, health, reflection)."""

from __future__ import annotations

import asyncio
import logging
import signal
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection
from sqlalchemy.orm import Session, sessionmaker

from services.common.cluster_token import CLUSTER_TOKEN_ENV
from services.common.identity import config_digest
from services.common.metrics import metrics_host, serve_metrics
from services.common.server import SERVER_OPTIONS, quiet_grpc_poller_wakeups
from services.common.tls import TlsConfig, add_port
from services.common.wire import DecodeErrorInterceptor
from services.control_plane.api.interceptors import AuthInterceptor, ErrorInterceptor
from services.control_plane.api.metrics import rollout_registry
from services.control_plane.api.placement_service import SERVICE_NAME as PLACEMENT_SERVICE
from services.control_plane.api.placement_service import attach_placement
from services.control_plane.api.servicer import METHOD_SCOPES, SERVICE_NAME, AdapterAdminServicer
from services.control_plane.domain.evidence import EvidenceStore
from services.control_plane.rollout.analyzer import DEFAULT_TICK_S, Analyzer
from services.control_plane.rollout.rollout_status import RolloutView
from services.control_plane.store.db import make_engine, make_session_factory, upgrade
from services.control_plane.store.keys import KeyStore
from services.control_plane.store.registry import Registry
from services.control_plane.store.storage import StorageConfig, clean_stale_staging
from services.control_plane.store.worker_credentials import WorkerCredentials
from slora.v1 import admin_pb2_grpc as pb_grpc
from slora_core.config import ModelConfig

log = logging.getLogger(__name__)
WORKER_AUTH_MODES = ("credential", "cluster-token")


@dataclass(frozen=True)
class ControlPlaneConfig:
    """Everything `slora control-plane` needs. `base_models` maps names to HF directories."""

    db_url: str
    listen: str = "127.0.0.1:50051"
    base_models: Mapping[str, Path] = field(default_factory=dict)
    storage: StorageConfig = field(default_factory=StorageConfig)
    max_rank: int = 64
    bootstrap_admin_key: str | None = None
    migrate: bool = False
    grace_s: float = 5.0
    metrics_port: int | None = None       # Prometheus endpoint (evidence, canary analysis)
    analyzer_tick_s: float = DEFAULT_TICK_S
    cluster_token: str | None = None      # PlacementService needs it; open when None (warned)
    # "credential": with a cluster token, workers present their own credential on the
    # placement stream (docs/security.md); "cluster-token": the shared token suffices (legacy).
    worker_auth: str = "credential"


@dataclass
class ControlPlane:
    """A built but not yet started server, with the parts tests and other services reuse."""

    server: grpc.aio.Server
    port: int
    registry: Registry
    keys: KeyStore
    health: Any
    evidence: EvidenceStore
    analyzer: Analyzer
    credentials: WorkerCredentials

    async def stop(self, grace_s: float) -> None:
        """Report NOT_SERVING first so load balancers move away, then drain."""
        await self.health.enter_graceful_shutdown()
        await self.server.stop(grace_s)


def build_registry(config: ControlPlaneConfig, sessions: sessionmaker[Session]) -> Registry:
    models = {name: ModelConfig.from_hf_dir(path) for name, path in config.base_models.items()}
    return Registry(sessions, models, config.storage, config.max_rank)


async def build_server(config: ControlPlaneConfig, sessions: sessionmaker[Session]) -> ControlPlane:
    """Wire registry, key store, interceptors, health and reflection; bind `config.listen`."""
    registry = build_registry(config, sessions)
    keys = KeyStore(sessions)
    credentials = WorkerCredentials(sessions)
    if config.worker_auth not in WORKER_AUTH_MODES:
        raise ValueError(f"worker_auth must be one of {WORKER_AUTH_MODES}")
    if config.worker_auth != "credential" and config.cluster_token:
        log.warning("worker_auth=%s: any holder of the cluster token can act as a worker",
                    config.worker_auth)
    if config.bootstrap_admin_key:
        await asyncio.to_thread(keys.ensure_bootstrap_key, config.bootstrap_admin_key)
    server = grpc.aio.server(
        # Decode checks innermost: an unauthenticated caller hears UNAUTHENTICATED first.
        interceptors=[ErrorInterceptor(),
                      AuthInterceptor(keys, METHOD_SCOPES, config.cluster_token,
                                      credentials if config.worker_auth == "credential" else None),
                      DecodeErrorInterceptor()],
        options=SERVER_OPTIONS,  # accepts the watch streams' keepalive pings
    )
    if not config.cluster_token:
        log.warning("no cluster token: PlacementService is open to anyone who reaches %s "
                    "(set --cluster-token / %s)", config.listen, CLUSTER_TOKEN_ENV)
    evidence = EvidenceStore()
    analyzer = Analyzer(sessions, registry, evidence, config.analyzer_tick_s)
    rollout = RolloutView(sessions, registry, evidence, analyzer)
    pb_grpc.add_AdapterAdminServiceServicer_to_server(
        AdapterAdminServicer(registry, keys, rollout), server)
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    reflection.enable_server_reflection(
        (SERVICE_NAME, PLACEMENT_SERVICE, health.SERVICE_NAME, reflection.SERVICE_NAME), server
    )
    port = add_port(server, config.listen, TlsConfig.from_env())  # TLS when configured
    if port == 0:
        raise OSError(f"cannot listen on {config.listen}")
    for name in ("", SERVICE_NAME):
        await health_servicer.set(name, health_pb2.HealthCheckResponse.SERVING)
    return ControlPlane(server, port, registry, keys, health_servicer, evidence, analyzer,
                        credentials)


async def serve(config: ControlPlaneConfig) -> None:
    """Run until SIGINT/SIGTERM, then shut down gracefully."""
    quiet_grpc_poller_wakeups()
    if config.migrate:
        await asyncio.to_thread(upgrade, config.db_url)
    for path in await asyncio.to_thread(clean_stale_staging):
        log.info("removed %s, left by a registration that never finished", path)
    engine = make_engine(config.db_url)
    sessions = make_session_factory(engine)
    plane = await build_server(config, sessions)
    # PlacementService (data plane <-> control plane); see services/control_plane/api/placement_service.py.
    hub = attach_placement(plane.server, sessions, evidence=plane.evidence,
                           credentials=plane.credentials,
                           base_models={name: config_digest(path)
                                        for name, path in config.base_models.items()})
    if config.metrics_port is not None:
        port = serve_metrics(config.metrics_port, rollout_registry(plane.evidence, plane.analyzer),
                             metrics_host(config.listen))
        log.info("metrics on :%d/metrics", port)
    # Before the placement stream takes heartbeats: they are news from the stored checkpoint.
    await asyncio.to_thread(plane.analyzer.restore_evidence)
    await plane.server.start()
    tasks = [asyncio.create_task(hub.run()), asyncio.create_task(plane.analyzer.run())]
    log.info("control plane listening on port %d", plane.port)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    for task in tasks:
        task.cancel()
    await plane.stop(config.grace_s)
    engine.dispose()
