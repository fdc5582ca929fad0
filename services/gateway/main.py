"""Wiring of a gateway process: routing-table watch, gRPC server, metrics, drain."""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass

import grpc

from services.common.cluster_token import cluster_metadata
from services.common.metrics import metrics_host, serve_metrics
from services.common.server import (
    GrpcServer,
    drain_and_stop,
    install_stop_handlers,
    quiet_grpc_poller_wakeups,
    start_server,
)
from services.common.watch import Outbox, watch_forever
from services.gateway.evidence import RoutedEvidence
from services.gateway.http_api import HttpApi
from services.gateway.http_server import start_http
from services.gateway.metrics import GatewayMetrics
from services.gateway.model_server_metrics import ModelServerCollector
from services.gateway.router import Router
from services.gateway.servicer import GatewayServicer
from services.gateway.siblings import Siblings, socket_target
from services.gateway.table import RoutingTable
from slora.v1 import inference_pb2, inference_pb2_grpc
from slora.v1 import placement_pb2 as ppb
from slora.v1 import placement_pb2_grpc as ppb_grpc

log = logging.getLogger(__name__)
SERVICE = inference_pb2.DESCRIPTOR.services_by_name["InferenceService"].full_name


@dataclass(frozen=True)
class GatewayOptions:
    control_plane: str
    listen: str
    gateway_id: str
    metrics_port: int | None = None
    drain_grace_s: float = 30.0
    cluster_token: str = ""    # presented on the routing stream (SLORA_CLUSTER_TOKEN)
    http_listen: str = ""      # host:port of the OpenAI-compatible HTTP API ("" = off)
    base_model_name: str = "base"  # the `model` that names the base model (no adapter) on HTTP
    # One process of several on the same ports (supervisor.py): SO_REUSEPORT, listening only
    # once the routing table came, and a Unix socket its siblings reach it on.
    shared_ports: bool = False
    own_socket: str = ""
    sibling_sockets: tuple[str, ...] = ()
    # Worker calls over one GenerateMux stream per worker once this process has this many
    # streams in flight on it (0: always), or None: one Generate call per request
    # (`slora gateway --upstream`, env SLORA_GATEWAY_UPSTREAM; Upstreams.mux_from). The CLI's
    # default is auto (MUX_FROM_DEFAULT); built directly, options call per request.
    upstream_mux_from: int | None = None


DEFAULT_REPORT_S = 1.0


class RoutingWatcher:
    """Keeps `table` in sync with the control plane; the gateway is ready after the first
    snapshot and keeps serving from its last table while the control plane is away.

    The same stream carries the gateway's evidence the other way: every report interval (the
    control plane sets it) the per-version counters and feedback gathered since the previous
    report. A report in flight when the stream breaks is lost: evidence is statistical, and
    that loss is bounded by one interval."""

    def __init__(self, target: str, gateway_id: str, table: RoutingTable,
                 metrics: GatewayMetrics, on_synced: asyncio.Event,
                 evidence: RoutedEvidence | None = None, cluster_token: str = "") -> None:
        self.target, self.gateway_id, self.table = target, gateway_id, table
        self.metrics, self.on_synced = metrics, on_synced
        self.evidence = evidence
        self.cluster_token = cluster_token
        self.report_s = DEFAULT_REPORT_S

    async def run(self) -> None:
        await watch_forever(self.target, self._open, self._hello, self._on_update,
                            on_connected=self._reports if self.evidence else None)

    async def _reports(self, outbox: Outbox) -> None:
        assert self.evidence is not None
        while True:
            await asyncio.sleep(self.report_s)
            report = self.evidence.drain()
            if report is not None:
                outbox.put(ppb.GatewayMessage(report=report))

    def _open(self, channel: grpc.aio.Channel) -> grpc.aio.StreamStreamCall:
        return ppb_grpc.PlacementServiceStub(channel).WatchRouting(
            metadata=cluster_metadata(self.cluster_token))

    def _hello(self) -> ppb.GatewayMessage:
        return ppb.GatewayMessage(hello=ppb.GatewayHello(gateway_id=self.gateway_id))

    async def _on_update(self, update: ppb.RoutingUpdate, outbox: Outbox) -> None:
        if update.report_interval_ms > 0:
            self.report_s = update.report_interval_ms / 1000
        self.table.apply(update)
        if update.snapshot:  # once per (re)connection
            log.info("routing snapshot %d: %d adapters, %d workers", update.revision,
                     len(update.adapters), len(update.workers))
        self.metrics.revision.set(update.revision)
        outbox.put(ppb.GatewayMessage(ack=ppb.Ack(revision=update.revision)))
        self.on_synced.set()


async def serve_gateway(opts: GatewayOptions) -> int:
    """Run until SIGTERM/SIGINT, then drain (NOT_SERVING, finish streams, stop)."""
    quiet_grpc_poller_wakeups()
    metrics = GatewayMetrics()
    if opts.metrics_port is not None:
        port = serve_metrics(opts.metrics_port, metrics.registry, metrics_host(opts.listen))
        log.info("gateway %s metrics on port %d", opts.gateway_id, port)
    table = RoutingTable()
    router = Router(table, metrics,
                    siblings=Siblings(opts.sibling_sockets) if opts.sibling_sockets else None,
                    mux_from=opts.upstream_mux_from)
    metrics.registry.register(ModelServerCollector(table, router.inflight))
    synced, stop = asyncio.Event(), asyncio.Event()
    install_stop_handlers(stop.set)
    watcher = asyncio.create_task(
        RoutingWatcher(opts.control_plane, opts.gateway_id, table, metrics, synced,
                       router.evidence, opts.cluster_token).run())
    # A process sharing its ports listens only once it can route: the kernel then hands new
    # connections to those of its siblings that can serve them.
    if opts.shared_ports:
        log.info("gateway %s waiting for the routing table, then listening", opts.gateway_id)
        if not await _first_set(synced, stop):
            watcher.cancel()
            return 0
    servicer = GatewayServicer(router)
    handle: GrpcServer = await start_server(
        opts.listen, lambda s: inference_pb2_grpc.add_InferenceServiceServicer_to_server(servicer, s),
        [SERVICE], serving=False, reuse_port=opts.shared_ports)
    own = await _serve_siblings(opts.own_socket, servicer) if opts.own_socket else None
    http = (await start_http(opts.http_listen, HttpApi(router, metrics, opts.base_model_name),
                             reuse_port=opts.shared_ports) if opts.http_listen else None)
    log.info("gateway %s on port %d%s%s", opts.gateway_id, handle.port,
             f" (HTTP on {opts.http_listen})" if http else "",
             "" if synced.is_set() else ", waiting for the routing table")
    if await _first_set(synced, stop):
        await handle.set_serving(True)
        log.info("gateway %s ready (routing revision %d)", opts.gateway_id, table.revision)
    await stop.wait()
    router.draining = True
    await drain_and_stop(handle, router.wait_idle, opts.drain_grace_s)
    if http is not None:
        await http.stop()
    if own is not None:
        await own.stop(grace=1.0)
    watcher.cancel()
    await router.upstreams.close()
    return 0


async def _first_set(wanted: asyncio.Event, stop: asyncio.Event) -> bool:
    """Wait until `wanted` or `stop` is set; True when `wanted` is."""
    waiters = [asyncio.create_task(wanted.wait()), asyncio.create_task(stop.wait())]
    await asyncio.wait(waiters, return_when=asyncio.FIRST_COMPLETED)
    for w in waiters:
        w.cancel()
    return wanted.is_set()


async def _serve_siblings(path: str, servicer: GatewayServicer) -> grpc.aio.Server:
    """The same InferenceService on a Unix socket, for the sibling processes' forwarded calls
    (the folder is the supervisor's, mode 0700)."""
    server = grpc.aio.server()
    inference_pb2_grpc.add_InferenceServiceServicer_to_server(servicer, server)
    if server.add_insecure_port(socket_target(path)) == 0:
        raise RuntimeError(f"cannot bind {path}")
    await server.start()
    return server
