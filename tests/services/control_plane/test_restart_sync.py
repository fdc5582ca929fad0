"""What a restarted control plane tells its subscribers first. A gateway gets its routing
snapshot as soon as the registry has been read, with no start-up grace (a grace that outlasts
the restart interval left gateways on stale routes for as long as restarts went on); it keeps
the workers of its previous table that the snapshot does not list yet as candidates of last
resort, so the snapshot costs it no worker. A worker that reconnects before the registry has
been read hears nothing until it has: an empty placement snapshot would make it forget every
version its gateways still route to it."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import pytest

from services.control_plane.api.placement_service import HubConfig, PlacementHub
from services.control_plane.store.db import make_engine, make_session_factory, upgrade
from services.gateway.table import CARRY_S, RoutingTable
from slora.v1 import placement_pb2 as ppb

pytestmark = pytest.mark.timeout(60)


def test_a_gateway_gets_its_snapshot_as_soon_as_the_registry_is_read(tmp_path: Path) -> None:
    db_url = f"sqlite:///{tmp_path / 'registry.db'}"
    upgrade(db_url)
    engine = make_engine(db_url)

    async def main() -> None:
        hub = PlacementHub(make_session_factory(engine), HubConfig(poll_s=0.02))
        early = hub.connect_gateway("early")  # before the first registry read
        assert early.queue.empty(), "a snapshot went out before the registry was read"
        started = time.monotonic()
        run = asyncio.create_task(hub.run())
        try:
            first = await asyncio.wait_for(early.queue.get(), timeout=10)
            assert first is not None and first.snapshot
            assert time.monotonic() - started < 1.0
            late = hub.connect_gateway("late")  # after: the snapshot is there at once
            update = late.queue.get_nowait()
            assert update is not None and update.snapshot and update.revision > first.revision
        finally:
            run.cancel()

    try:
        asyncio.run(main())
    finally:
        engine.dispose()


def endpoint(worker_id: str, up: bool = True) -> ppb.WorkerEndpoint:
    return ppb.WorkerEndpoint(worker_id=worker_id, address=f"{worker_id}:1", up=up)


def test_gateway_table_carries_workers_a_new_snapshot_lacks(
        monkeypatch: pytest.MonkeyPatch) -> None:
    table = RoutingTable()
    # w2 marked down by the dying control plane (late heartbeats): carried all the same.
    table.apply(ppb.RoutingUpdate(revision=1, snapshot=True,
                                  workers=[endpoint("w1"), endpoint("w2", up=False)]))
    # The restarted control plane's snapshot comes before its workers are back.
    table.apply(ppb.RoutingUpdate(revision=2, snapshot=True))
    assert table.workers == {}
    assert {w.worker_id for w in table.candidates("", "", {})} == {"w1", "w2"}
    # w1 reconnects: it is listed again and is the only candidate (w2 only as a last resort).
    table.apply(ppb.RoutingUpdate(revision=3, workers=[endpoint("w1")]))
    assert [w.worker_id for w in table.candidates("", "", {})] == ["w1"]
    # Removed by the control plane, or past CARRY_S: no longer a candidate.
    table.apply(ppb.RoutingUpdate(revision=4, removed_workers=["w1"]))
    assert [w.worker_id for w in table.candidates("", "", {})] == ["w2"]
    later = time.monotonic() + CARRY_S + 1
    monkeypatch.setattr(time, "monotonic", lambda: later)
    assert table.candidates("", "", {}) == []


def test_a_worker_back_before_the_registry_was_read_gets_its_snapshot_after(
        tmp_path: Path) -> None:
    db_url = f"sqlite:///{tmp_path / 'registry.db'}"
    upgrade(db_url)
    engine = make_engine(db_url)

    async def main() -> None:
        hub = PlacementHub(make_session_factory(engine), HubConfig(poll_s=0.02))
        worker = hub.connect_worker(ppb.WorkerHello(worker_id="w1", address="127.0.0.1:1",
                                                    capacity=4))
        assert worker.queue.empty(), "placement went out before the registry was read"
        run = asyncio.create_task(hub.run())  # its first poll reads the registry
        try:
            first = await asyncio.wait_for(worker.queue.get(), timeout=10)
            assert first is not None and first.snapshot
            assert first.heartbeat_interval_ms == 1000
        finally:
            run.cancel()

    try:
        asyncio.run(main())
    finally:
        engine.dispose()
