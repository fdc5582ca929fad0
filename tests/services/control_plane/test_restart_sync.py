"""What a restarted control plane tells its subscribers first. Gateways' first routing snapshot
waits until a worker is back: a snapshot without workers would leave a gateway nowhere to send
requests, while its last table (from before the restart) still works; the wait is bounded, so a
cluster that really has no worker gets its snapshot too. A worker that reconnects before the
registry has been read hears nothing until it has: an empty placement snapshot would make it
forget every version its gateways still route to it."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import pytest

from services.control_plane.api.placement_service import HubConfig, PlacementHub
from services.control_plane.store.db import make_engine, make_session_factory, upgrade
from slora.v1 import placement_pb2 as ppb

pytestmark = pytest.mark.timeout(60)
GRACE_S = 0.5


def first_snapshot(tmp_path: Path, worker_after_s: float | None) -> tuple[float, list[str]]:
    """Seconds from the hub's start until a gateway that connected at once got its snapshot,
    and the workers the snapshot lists; a worker connects `worker_after_s` after the start."""
    db_url = f"sqlite:///{tmp_path / 'registry.db'}"
    upgrade(db_url)
    engine = make_engine(db_url)

    async def main() -> tuple[float, list[str]]:
        hub = PlacementHub(make_session_factory(engine),
                           HubConfig(poll_s=0.02, startup_grace_s=GRACE_S))
        started = time.monotonic()
        run = asyncio.create_task(hub.run())
        gateway = hub.connect_gateway("g1")
        ready = asyncio.create_task(hub.wait_ready_then_snapshot(gateway))
        try:
            if worker_after_s is not None:
                await asyncio.sleep(worker_after_s)
                assert gateway.queue.empty(), "a snapshot went out before the worker was back"
                hub.connect_worker(ppb.WorkerHello(worker_id="w1", address="127.0.0.1:1",
                                                   capacity=4))
            update = await asyncio.wait_for(gateway.queue.get(), timeout=10)
            assert update is not None and update.snapshot
            return time.monotonic() - started, sorted(w.worker_id for w in update.workers)
        finally:
            ready.cancel()
            run.cancel()

    try:
        return asyncio.run(main())
    finally:
        engine.dispose()


def test_the_first_snapshot_waits_past_the_grace_for_a_returning_worker(tmp_path: Path) -> None:
    # The worker comes back after the plain grace but well before the bounded wait ends.
    waited, workers = first_snapshot(tmp_path, worker_after_s=2 * GRACE_S)
    assert workers == ["w1"]
    assert 2 * GRACE_S <= waited < 3 * GRACE_S


def test_with_no_worker_the_first_snapshot_comes_when_the_bounded_wait_ends(
        tmp_path: Path) -> None:
    waited, workers = first_snapshot(tmp_path, worker_after_s=None)
    assert workers == []
    factor = HubConfig().no_worker_grace_factor
    assert factor > 1 and factor * GRACE_S <= waited < factor * GRACE_S + 2.0


def test_a_worker_back_within_the_grace_gets_the_snapshot_when_the_grace_ends(
        tmp_path: Path) -> None:
    waited, workers = first_snapshot(tmp_path, worker_after_s=0.0)
    assert workers == ["w1"]
    assert GRACE_S <= waited < GRACE_S + 1.0


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
