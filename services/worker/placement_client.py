"""The worker's side of PlacementService.WatchPlacement: apply placements, send heartbeats."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from dataclasses import dataclass

import grpc

from services.common.identity import worker_metadata
from services.common.versions import worker_counters_to_pb
from services.common.watch import Outbox, watch_forever
from services.worker.adapters import AdapterManager
from services.worker.core_client import CoreClient
from services.worker.metrics import WorkerMetrics
from slora.v1 import placement_pb2 as ppb
from slora.v1 import placement_pb2_grpc as ppb_grpc

DEFAULT_HEARTBEAT_S = 1.0


@dataclass(frozen=True)
class WorkerIdentity:
    worker_id: str
    address: str
    capacity: int
    base_model: str
    config_sha256: str = ""  # identity.config_digest of the model directory


class PlacementClient:
    def __init__(self, target: str, identity: WorkerIdentity, adapters: AdapterManager,
                 core: CoreClient, metrics: WorkerMetrics,
                 is_draining: Callable[[], bool] = lambda: False, cluster_token: str = "",
                 ) -> None:
        self.target = target
        self.cluster_token = cluster_token
        self.identity = identity
        self.adapters = adapters
        self.core = core
        self.metrics = metrics
        self.is_draining = is_draining
        self.heartbeat_s = DEFAULT_HEARTBEAT_S
        self.started_at_ms = int(time.time() * 1000)
        self.revision = 0
        self.synced = asyncio.Event()

    async def run(self) -> None:
        """Watch placement until cancelled, reconnecting as needed."""
        await watch_forever(self.target, self._open, self._hello, self._on_update,
                            on_connected=self._heartbeats)

    def _open(self, channel: grpc.aio.Channel) -> grpc.aio.StreamStreamCall:
        return ppb_grpc.PlacementServiceStub(channel).WatchPlacement(
            metadata=worker_metadata(self.cluster_token))

    def _hello(self) -> ppb.WorkerMessage:
        i = self.identity
        return ppb.WorkerMessage(hello=ppb.WorkerHello(
            worker_id=i.worker_id, address=i.address, capacity=i.capacity,
            base_model=i.base_model, config_sha256=i.config_sha256))

    async def _on_update(self, update: ppb.PlacementUpdate, outbox: Outbox) -> None:
        if update.heartbeat_interval_ms > 0:
            self.heartbeat_s = update.heartbeat_interval_ms / 1000
        await self.adapters.apply(update)
        self.revision = update.revision
        outbox.put(ppb.WorkerMessage(ack=ppb.Ack(revision=update.revision)))
        self.synced.set()

    async def _heartbeats(self, outbox: Outbox) -> None:
        while True:
            outbox.put(ppb.WorkerMessage(heartbeat=await self.heartbeat()))
            await self.adapters.refresh_pins()
            await asyncio.sleep(self.heartbeat_s)

    async def heartbeat(self) -> ppb.Heartbeat:
        """Load, residency, pages and per-version counters, as of now."""
        resident = self.adapters.resident()
        state = self.core.state  # as of the core's latest step
        running, waiting = state.running, state.waiting
        counters = [worker_counters_to_pb(k, c) for k, c in list(self.metrics.counters.items())]
        # Requests still on their way to the engine count as load too.
        inflight = max(len(self.core.streams), running + waiting)
        return ppb.Heartbeat(
            running=running, waiting=waiting, load=inflight / self.core.config.max_num_seqs,
            resident=[ppb.VersionKey(adapter_id=a, version=v) for a, v in resident],
            counters=counters, kv_pages=state.kv_pages, adapter_pages=state.adapter_pages,
            free_pages=state.free_pages,
            started_at_ms=self.started_at_ms, draining=self.is_draining(),
            running_adapters=[version_key(n) for n in state.running_adapters],
            waiting_adapters=[version_key(n) for n in state.waiting_adapters],
            max_num_seqs=self.core.config.max_num_seqs,
        )


def version_key(engine_name: str) -> ppb.VersionKey:
    adapter_id, _, version = engine_name.rpartition("@")
    return ppb.VersionKey(adapter_id=adapter_id, version=version)
