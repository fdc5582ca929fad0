"""PlacementService: placements streamed to workers, the routing table streamed to gateways.

The hub keeps the registry catalog (polled: every registry change leaves an audit event, so a
change of the newest event id is the signal), the connected workers and their heartbeats, and
the connected gateways. Any change recomputes the plan and the routing table, diffs them
against what each subscriber was sent, and pushes deltas under one rising revision.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass, field

import grpc
from sqlalchemy.orm import Session, sessionmaker

from services.common.errors import AlreadyExists, InvalidArgument, PermissionDenied
from services.common.names import check_name, check_worker_id
from services.common.versions import VersionKey, key_from_pb, key_to_pb
from services.control_plane.api.interceptors import current_worker
from services.control_plane.api.routing_state import (
    RoutingState,
    WorkerView,
    build_routing_state,
    routing_delta,
    worker_endpoint,
)
from services.control_plane.domain.evidence import EvidenceStore
from services.control_plane.domain.placement import (
    PIN,
    PlannerConfig,
    WorkerSlot,
    plan,
    popular_versions,
)
from services.control_plane.store.catalog import Catalog, fingerprint, load_catalog
from services.control_plane.store.worker_credentials import WorkerCredentials
from slora.v1 import placement_pb2 as ppb
from slora.v1 import placement_pb2_grpc as ppb_grpc

log = logging.getLogger(__name__)
SERVICE_NAME = ppb.DESCRIPTOR.services_by_name["PlacementService"].full_name
MAX_ADDRESS_CHARS = 256


@dataclass(frozen=True)
class HubConfig:
    poll_s: float = 0.2             # registry change detection
    heartbeat_s: float = 1.0        # asked of workers
    missed_heartbeats: int = 3      # then a worker is down
    popularity_window_s: float = 10.0
    planner: PlannerConfig = PlannerConfig()

    @classmethod
    def from_env(cls, env: Mapping[str, str] = os.environ) -> HubConfig:
        """SLORA_HEARTBEAT_S, SLORA_MISSED_HEARTBEATS, SLORA_POLL_S override the defaults."""
        hb = float(env.get("SLORA_HEARTBEAT_S", cls.heartbeat_s))
        missed = int(env.get("SLORA_MISSED_HEARTBEATS", cls.missed_heartbeats))
        return cls(poll_s=float(env.get("SLORA_POLL_S", cls.poll_s)), heartbeat_s=hb,
                   missed_heartbeats=missed)


@dataclass(eq=False)
class WorkerConn:
    worker_id: str
    address: str
    capacity: int
    queue: asyncio.Queue[ppb.PlacementUpdate | None] = field(default_factory=asyncio.Queue)
    sent: dict[VersionKey, ppb.VersionPlacement] = field(default_factory=dict)
    last_seen: float = field(default_factory=time.monotonic)
    up: bool = True
    load: float = 0.0
    draining: bool = False
    resident: frozenset[VersionKey] = frozenset()
    acked: int = 0
    started_at_ms: int = 0
    requests: dict[VersionKey, int] = field(default_factory=dict)
    heartbeat: ppb.Heartbeat | None = None  # the latest
    bound: bool = False  # authenticated by a worker credential bound to worker_id
    # Its first placement is a snapshot, sent once the registry has been read (see ready).
    has_snapshot: bool = False


@dataclass(eq=False)
class GatewayConn:
    gateway_id: str
    queue: asyncio.Queue[ppb.RoutingUpdate | None] = field(default_factory=asyncio.Queue)
    acked: int = 0
    # Deltas go only to gateways that have their snapshot: a delta applied before it (a
    # gateway that connected before the registry was read) showed workers without keys or
    # routes.
    has_snapshot: bool = False


class PlacementHub:
    def __init__(self, sessions: sessionmaker[Session], config: HubConfig = HubConfig(),
                 evidence: EvidenceStore | None = None,
                 credentials: WorkerCredentials | None = None,
                 base_models: Mapping[str, str] | None = None) -> None:
        self.sessions = sessions
        # Base model name -> config digest (identity.config_digest) of what this control plane
        # serves: a worker's hello must carry one of them (its credential's, when bound).
        self.base_models = dict(base_models or {})
        # Revoking a worker's credential also ends its live stream (checked on registry change).
        self.credentials = credentials
        self.config = config
        # Per-version canary evidence from worker heartbeats and gateway reports.
        self.evidence = evidence or EvidenceStore()
        self.catalog = Catalog()
        self.workers: dict[str, WorkerConn] = {}
        self.gateways: set[GatewayConn] = set()
        self.plan: dict[str, dict[VersionKey, str]] = {}
        self.routing = RoutingState()
        self.popular: set[VersionKey] = set()
        # Microseconds since the epoch: revisions keep rising across control-plane restarts.
        self._revision = time.time_ns() // 1000
        self._window: dict[VersionKey, int] = {}
        # The registry has been read once. Before that the catalog is empty: a worker that
        # reconnected to a restarted control plane in that moment got an empty snapshot and
        # forgot every version ("not known here" for requests its gateways still sent it).
        # Gateways get their snapshot as soon as it is set, with no start-up grace: a gateway
        # keeps the workers of its previous table that the snapshot does not list yet for a
        # while (gateway/table.py), so a snapshot sent before the workers are back costs it
        # nothing, and a control plane restarting often never leaves its routes stale.
        self.ready = asyncio.Event()

    def next_revision(self) -> int:
        self._revision += 1
        return self._revision

    # ---- background loop ----------------------------------------------------------------
    async def run(self) -> None:
        """Poll the registry, expire silent workers, refresh popularity; until cancelled.
        Cancelling it also ends every subscriber's stream, so a shutdown need not wait out the
        server's grace period for these never-ending calls."""
        try:
            await self._poll_forever()
        finally:
            for worker in self.workers.values():
                worker.queue.put_nowait(None)
            for gateway in self.gateways:
                gateway.queue.put_nowait(None)

    async def _poll_forever(self) -> None:
        last_fp = -1
        last_pop = time.monotonic()
        while True:
            try:
                fp = await asyncio.to_thread(fingerprint, self.sessions)
                if fp != last_fp:
                    self.catalog = await asyncio.to_thread(load_catalog, self.sessions)
                    last_fp = fp
                    await self._drop_revoked()
                    first = not self.ready.is_set()
                    self.ready.set()
                    self.recompute()
                    if first:
                        self._snapshot_waiting_gateways()
            except Exception:
                log.exception("placement: reading the registry failed; retrying")
            self._expire_workers()
            if time.monotonic() - last_pop >= self.config.popularity_window_s:
                self._refresh_popularity(time.monotonic() - last_pop)
                last_pop = time.monotonic()
            await asyncio.sleep(self.config.poll_s)

    async def _drop_revoked(self) -> None:
        if self.credentials is None:
            return
        active = await asyncio.to_thread(self.credentials.active_worker_ids)
        for conn in self.workers.values():
            if conn.bound and conn.worker_id not in active:
                log.warning("worker %s: credential revoked; closing its stream", conn.worker_id)
                conn.queue.put_nowait(None)

    def _expire_workers(self) -> None:
        limit = self.config.heartbeat_s * self.config.missed_heartbeats
        now = time.monotonic()
        expired = [w for w in self.workers.values() if w.up and now - w.last_seen > limit]
        for w in expired:
            log.warning("worker %s missed heartbeats for %.1fs: marked down", w.worker_id, limit)
            w.up = False
        if expired:
            self.recompute()

    def _refresh_popularity(self, elapsed: float) -> None:
        rates = {k: n / elapsed for k, n in self._window.items()}
        self._window.clear()
        popular = popular_versions(rates, self.config.planner)
        if popular != self.popular:
            self.popular = popular
            self.recompute()

    # ---- recompute and push -------------------------------------------------------------
    def recompute(self) -> None:
        routed = [(a.adapter_id, v) for a in self.catalog.adapters for v in a.routed_versions()]
        slots = [WorkerSlot(w.worker_id, w.capacity) if w.capacity > 0 else WorkerSlot(w.worker_id)
                 for w in self.workers.values() if w.up and not w.draining]
        self.plan = plan(routed, slots, self.popular, self.config.planner)
        for conn in self.workers.values():
            self._push_placement(conn, snapshot=False)
        views = [_view(w) for w in self.workers.values()]
        new = build_routing_state(self.catalog, self.plan, views)
        if self.ready.is_set():
            delta = routing_delta(self.routing, new)
            if delta is not None:
                delta.revision = self.next_revision()
                for gw in self.gateways:
                    if gw.has_snapshot:
                        gw.queue.put_nowait(delta)
        self.routing = new

    def _desired(self, worker_id: str) -> dict[VersionKey, ppb.VersionPlacement]:
        assigned = self.plan.get(worker_id, {})
        out = {}
        for a in self.catalog.adapters:
            for v in a.versions:
                key = (a.adapter_id, v.version)
                r = assigned.get(key)
                residency = (ppb.RESIDENCY_ON_DEMAND if r is None else
                             ppb.RESIDENCY_PIN if r == PIN else ppb.RESIDENCY_PREFETCH)
                out[key] = ppb.VersionPlacement(adapter_id=a.adapter_id, version=v.version,
                                                storage_uri=v.storage_uri, sha256=v.sha256,
                                                residency=residency)
        return out

    def _push_placement(self, conn: WorkerConn, snapshot: bool) -> None:
        if not self.ready.is_set():
            return  # a worker hears nothing until the registry has been read
        desired = self._desired(conn.worker_id)
        snapshot = snapshot or not conn.has_snapshot
        conn.has_snapshot = True
        if snapshot:
            upserts, removals = list(desired.values()), []
        else:
            upserts = [p for k, p in desired.items() if conn.sent.get(k) != p]
            removals = [k for k in conn.sent if k not in desired]
            if not upserts and not removals:
                return
        conn.sent = desired
        conn.queue.put_nowait(ppb.PlacementUpdate(
            revision=self.next_revision(), snapshot=snapshot, upserts=upserts,
            removals=[key_to_pb(k) for k in removals],
            heartbeat_interval_ms=int(self.config.heartbeat_s * 1000)))

    # ---- subscribers --------------------------------------------------------------------
    def connect_worker(self, hello: ppb.WorkerHello, bound: bool = False) -> WorkerConn:
        """Add a worker; AlreadyExists while another stream under the same id is live (a
        duplicate is refused, not swapped in). A stale one (missed heartbeats) is replaced."""
        old = self.workers.get(hello.worker_id)
        if old is not None and old.up:
            raise AlreadyExists(f"worker {hello.worker_id} is already connected; a second "
                                "process with the same id is refused")
        if old is not None:
            old.queue.put_nowait(None)
        conn = WorkerConn(hello.worker_id, hello.address, hello.capacity, bound=bound)
        self.workers[conn.worker_id] = conn
        log.info("worker %s connected from %s", conn.worker_id, conn.address)
        self.recompute()
        self._push_placement(conn, snapshot=True)
        return conn

    def disconnect_worker(self, conn: WorkerConn) -> None:
        if self.workers.get(conn.worker_id) is conn:
            del self.workers[conn.worker_id]
            log.info("worker %s disconnected; re-placing its adapters", conn.worker_id)
            self.recompute()

    def heartbeat(self, conn: WorkerConn, hb: ppb.Heartbeat) -> None:
        conn.last_seen = time.monotonic()
        self.evidence.worker_counters(conn.worker_id, hb.started_at_ms, hb.counters)
        if hb.started_at_ms != conn.started_at_ms:
            conn.started_at_ms, conn.requests = hb.started_at_ms, {}
        for c in hb.counters:
            key = (c.adapter_id, c.version)
            if c.adapter_id:
                self._window[key] = self._window.get(key, 0) + c.requests - conn.requests.get(key, 0)
            conn.requests[key] = c.requests
        resident = frozenset(key_from_pb(r) for r in hb.resident)
        changed = (not conn.up or resident != conn.resident or hb.draining != conn.draining
                   or abs(hb.load - conn.load) >= 0.05)
        conn.up, conn.resident, conn.draining, conn.load = True, resident, hb.draining, hb.load
        conn.heartbeat = hb
        if changed:
            self.recompute()
        else:
            self._push_load(conn)

    def _push_load(self, conn: WorkerConn) -> None:
        """Send gateways a worker whose load figures changed and nothing else (their
        model-server metrics), without re-planning: one endpoint per heartbeat at most."""
        old = self.routing.workers.get(conn.worker_id)
        endpoint = worker_endpoint(_view(conn))
        if old is None or old == endpoint:
            return
        self.routing.workers[conn.worker_id] = endpoint
        if self.ready.is_set():
            update = ppb.RoutingUpdate(revision=self.next_revision(), workers=[endpoint])
            for gw in self.gateways:
                if gw.has_snapshot:
                    gw.queue.put_nowait(update)

    def connect_gateway(self, gateway_id: str) -> GatewayConn:
        conn = GatewayConn(gateway_id)
        self.gateways.add(conn)
        if self.ready.is_set():
            conn.queue.put_nowait(self._routing_snapshot())
            conn.has_snapshot = True
        return conn

    def _routing_snapshot(self) -> ppb.RoutingUpdate:
        update = self.routing.snapshot(self.next_revision())
        # Gateways report their evidence as often as workers send heartbeats.
        update.report_interval_ms = int(self.config.heartbeat_s * 1000)
        return update

    def disconnect_gateway(self, conn: GatewayConn) -> None:
        self.gateways.discard(conn)

    def _snapshot_waiting_gateways(self) -> None:
        """Gateways that connected before the registry was read get their snapshot now."""
        for conn in self.gateways:
            if not conn.has_snapshot:
                conn.queue.put_nowait(self._routing_snapshot())
                conn.has_snapshot = True


class PlacementServicer(ppb_grpc.PlacementServiceServicer):
    def __init__(self, hub: PlacementHub) -> None:
        self.hub = hub

    async def WatchPlacement(self, request_iterator: AsyncIterator[ppb.WorkerMessage],
                             context: grpc.aio.ServicerContext
                             ) -> AsyncIterator[ppb.PlacementUpdate]:
        first = await anext(aiter(request_iterator), None)
        if first is None or not first.HasField("hello") or not first.hello.worker_id:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "send a hello with a worker_id first")
            return  # unreached: abort raises; this narrows `first` for the type checker
        hello = first.hello
        check_worker_id(hello.worker_id)
        if len(hello.address) > MAX_ADDRESS_CHARS:
            raise InvalidArgument(f"worker address is over {MAX_ADDRESS_CHARS} chars")
        binding = current_worker()
        if binding is not None and binding.worker_id != hello.worker_id:
            raise PermissionDenied(f"this credential belongs to worker {binding.worker_id}, "
                                   f"not {hello.worker_id}")
        check_base_model(hello, binding.base_model if binding else None, self.hub.base_models)
        conn = self.hub.connect_worker(hello, bound=binding is not None)
        reader = asyncio.create_task(self._read_worker(request_iterator, conn))
        try:
            while (update := await conn.queue.get()) is not None:
                yield update
        finally:
            reader.cancel()
            self.hub.disconnect_worker(conn)

    async def _read_worker(self, messages: AsyncIterator[ppb.WorkerMessage],
                           conn: WorkerConn) -> None:
        try:
            async for msg in messages:
                if msg.HasField("ack"):
                    conn.acked = msg.ack.revision
                elif msg.HasField("heartbeat"):
                    self.hub.heartbeat(conn, msg.heartbeat)
        finally:
            conn.queue.put_nowait(None)

    async def WatchRouting(self, request_iterator: AsyncIterator[ppb.GatewayMessage],
                           context: grpc.aio.ServicerContext) -> AsyncIterator[ppb.RoutingUpdate]:
        first = await anext(aiter(request_iterator), None)
        if first is None or not first.HasField("hello"):
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "send a hello first")
            return  # unreached: abort raises; this narrows `first` for the type checker
        if first.hello.gateway_id:
            check_name("gateway_id", first.hello.gateway_id)
        conn = self.hub.connect_gateway(first.hello.gateway_id)
        reader = asyncio.create_task(self._read_gateway(request_iterator, conn))
        try:
            while (update := await conn.queue.get()) is not None:
                yield update
        finally:
            reader.cancel()
            self.hub.disconnect_gateway(conn)

    async def _read_gateway(self, messages: AsyncIterator[ppb.GatewayMessage],
                            conn: GatewayConn) -> None:
        try:
            async for msg in messages:
                if msg.HasField("ack"):
                    conn.acked = msg.ack.revision
                elif msg.HasField("report"):
                    self.hub.evidence.gateway_report(msg.report)
        finally:
            conn.queue.put_nowait(None)


def check_base_model(hello: ppb.WorkerHello, bound: str | None,
                     base_models: Mapping[str, str]) -> None:
    """PermissionDenied unless the hello's config digest is the one of the base model its
    credential is bound to (`bound`), or, for an unbound credential, one of those this control
    plane serves. A control plane that knows no base model checks only that a bound model is
    named in its configuration."""
    if bound is not None:
        expected = base_models.get(bound)
        if expected is None and base_models:
            raise PermissionDenied(f"this credential is bound to base model {bound!r}, which "
                                   "this control plane does not serve")
        if expected is not None and hello.config_sha256 != expected:
            raise PermissionDenied(
                f"this credential is bound to base model {bound!r} (config sha256 "
                f"{expected[:12]}...); the worker announced {hello.config_sha256[:12] or 'none'}")
        return
    if base_models and hello.config_sha256 not in base_models.values():
        raise PermissionDenied(f"the worker's base model (config sha256 "
                               f"{hello.config_sha256[:12] or 'none'}) is none this control "
                               f"plane serves ({', '.join(sorted(base_models))})")


def _view(w: WorkerConn) -> WorkerView:
    return WorkerView(w.worker_id, w.address, w.up, w.load, w.draining, w.resident, w.heartbeat)


def attach_placement(server: grpc.aio.Server, sessions: sessionmaker[Session],
                     config: HubConfig | None = None,
                     evidence: EvidenceStore | None = None,
                     credentials: WorkerCredentials | None = None,
                     base_models: Mapping[str, str] | None = None) -> PlacementHub:
    """Add PlacementService to `server`; run the returned hub's `run()` as a task. With
    `credentials`, a revoked worker credential also closes that worker's live stream;
    `base_models` (name -> config digest) are the models workers may announce."""
    hub = PlacementHub(sessions, config or HubConfig.from_env(), evidence, credentials,
                       base_models)
    ppb_grpc.add_PlacementServiceServicer_to_server(PlacementServicer(hub), server)
    return hub
