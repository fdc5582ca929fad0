"""A control plane restarted under its subscribers leaves no ERROR in anyone's log: the watch
streams of a gateway and a worker (services/common/watch.py) reconnect without grpc abandoning
a request-iterator task ("Task was destroyed but it is pending!", "aclose(): asynchronous
generator is already running"), and the control plane's auth guard does not reset its
ContextVar from another context when a placement stream closes early (ValueError)."""

from __future__ import annotations

import asyncio
import gc
import logging
from pathlib import Path
from typing import Any

import pytest

from services.common.processes import free_port
from services.common.server import quiet_grpc_poller_wakeups
from services.common.watch import Outbox, watch_forever
from services.control_plane.api.placement_service import HubConfig, attach_placement
from services.control_plane.api.server import ControlPlaneConfig, build_server
from services.control_plane.domain.principal import SYSTEM
from services.control_plane.store.db import make_engine, make_session_factory, upgrade
from services.control_plane.store.worker_credentials import WorkerCredentials
from slora.v1 import placement_pb2 as ppb
from slora.v1 import placement_pb2_grpc as ppb_grpc

pytestmark = pytest.mark.timeout(60)
CLUSTER_TOKEN = "slc_" + "t" * 40


class Subscriber:
    """One watch stream (gateway or worker side) counting the updates it got."""

    def __init__(self, address: str, kind: str, credential: str = "",
                 worker_id: str = "w1") -> None:
        self.address, self.kind, self.credential = address, kind, credential
        self.worker_id = worker_id
        self.updates = 0

    def open(self, channel: Any) -> Any:
        stub = ppb_grpc.PlacementServiceStub(channel)
        if self.kind == "gateway":
            return stub.WatchRouting(metadata=(("authorization", f"Bearer {CLUSTER_TOKEN}"),))
        return stub.WatchPlacement(metadata=(("authorization", f"Bearer {self.credential}"),))

    def hello(self) -> Any:
        if self.kind == "gateway":
            return ppb.GatewayMessage(hello=ppb.GatewayHello(gateway_id="g1"))
        return ppb.WorkerMessage(hello=ppb.WorkerHello(worker_id=self.worker_id,
                                                       address="127.0.0.1:1"))

    async def on_update(self, update: Any, outbox: Outbox) -> None:
        self.updates += 1
        ack = ppb.Ack(revision=update.revision)
        outbox.put(ppb.GatewayMessage(ack=ack) if self.kind == "gateway"
                   else ppb.WorkerMessage(ack=ack))

    async def beats(self, outbox: Outbox) -> None:
        while self.kind == "worker":  # heartbeats keep writes in flight as the server dies
            outbox.put(ppb.WorkerMessage(heartbeat=ppb.Heartbeat(started_at_ms=1)))
            await asyncio.sleep(0.02)

    def run(self) -> asyncio.Task[None]:
        return asyncio.create_task(watch_forever(self.address, self.open, self.hello,
                                                 self.on_update, on_connected=self.beats))


async def scenario(db_url: str, address: str, errors: list[str]) -> None:
    asyncio.get_running_loop().set_exception_handler(
        lambda _loop, ctx: errors.append(f"{ctx.get('message')}: {ctx.get('exception')!r}"))
    quiet_grpc_poller_wakeups()  # as every service's main does: grpc's own EAGAIN is not ours
    engine = make_engine(db_url)
    sessions = make_session_factory(engine)
    credential = WorkerCredentials(sessions).mint("w1", SYSTEM)
    early_credentials = [WorkerCredentials(sessions).mint(f"early-{i}", SYSTEM)
                         for i in range(3)]
    subscribers = [Subscriber(address, "gateway"), Subscriber(address, "worker", credential)]
    watches = [s.run() for s in subscribers]
    try:
        for restart in range(4):
            plane = await build_server(ControlPlaneConfig(
                db_url=db_url, listen=address, cluster_token=CLUSTER_TOKEN), sessions)
            hub = attach_placement(plane.server, sessions, HubConfig(poll_s=0.02))
            await plane.server.start()
            hub_task = asyncio.create_task(hub.run())
            seen = [s.updates for s in subscribers]
            while any(s.updates == n for s, n in zip(subscribers, seen, strict=True)):
                await asyncio.sleep(0.02)
            await asyncio.sleep(0.2)  # heartbeats and acks flowing
            hub_task.cancel()
            # Alternately a graceful stop and an abrupt one.
            await plane.server.stop(0.5 if restart % 2 else None)
            await asyncio.sleep(0.1)
        # Placement clients that close early, while the control plane stays up.
        plane = await build_server(ControlPlaneConfig(
            db_url=db_url, listen=address, cluster_token=CLUSTER_TOKEN), sessions)
        hub = attach_placement(plane.server, sessions, HubConfig(poll_s=0.02))
        await plane.server.start()
        hub_task = asyncio.create_task(hub.run())
        for i in range(3):
            early = Subscriber(address, "worker", early_credentials[i], f"early-{i}")
            task = early.run()
            while not early.updates:
                await asyncio.sleep(0.02)
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
            await asyncio.sleep(0.1)
        hub_task.cancel()
        await plane.server.stop(None)
        gc.collect()  # abandoned tasks and generators report when collected
        await asyncio.sleep(0.1)
    finally:
        for w in watches:
            w.cancel()
        await asyncio.gather(*watches, return_exceptions=True)
        engine.dispose()


def test_restarts_leave_no_error_in_the_subscribers_or_the_control_plane(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    db_url = f"sqlite:///{tmp_path / 'registry.db'}"
    upgrade(db_url)
    errors: list[str] = []
    with caplog.at_level(logging.INFO):
        asyncio.run(scenario(db_url, f"127.0.0.1:{free_port()}", errors))
    bad = [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]
    assert not bad and not errors, (bad, errors)
    # The streams really were cut and reopened (else the test proves nothing).
    assert sum("worker w1 connected" in r.getMessage() for r in caplog.records) >= 4
    assert sum("worker early-" in r.getMessage() and "disconnected" in r.getMessage()
               for r in caplog.records) == 3
