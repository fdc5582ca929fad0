"""Worker identity (issue 14), on SQLite and PostgreSQL: a process holding only the cluster
token cannot become a worker, so a gateway routes 0 of 40 calls to it even when it claims load
0 and every version warm; a credential works only for its own worker id; a duplicate live id is
refused, not swapped in; revoking a credential closes that worker's stream and routing drops it.

Everything runs in one event loop: the control plane, a real gateway (router, routing watch and
gRPC server), and two fake workers (InferenceService servers that count their calls and speak
the placement protocol as a worker does)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path

import grpc
import pytest

from services.common.cluster_token import cluster_metadata, new_cluster_token
from services.common.identity import config_digest
from services.common.server import start_server
from services.control_plane.api.placement_service import HubConfig, attach_placement
from services.control_plane.api.server import ControlPlane, ControlPlaneConfig, build_server
from services.control_plane.domain.placement import PlannerConfig, WorkerSlot, plan
from services.control_plane.domain.principal import SYSTEM
from services.control_plane.store.db import make_engine, make_session_factory, upgrade
from services.control_plane.store.publish import RegisterRequest
from services.control_plane.store.storage import StorageConfig
from services.gateway.main import SERVICE, RoutingWatcher
from services.gateway.metrics import GatewayMetrics
from services.gateway.router import Router
from services.gateway.servicer import GatewayServicer
from services.gateway.table import RoutingTable, token_sha256
from slora.v1 import inference_pb2 as pb
from slora.v1 import inference_pb2_grpc as pb_grpc
from slora.v1 import placement_pb2 as ppb
from slora.v1 import placement_pb2_grpc as ppb_grpc
from slora_core.adapters import digest_adapter_dir
from tests.services.control_plane.cp_support import BASE, MAX_RANK, status_lost

TOKEN = new_cluster_token()
ADAPTER = ("sec/bot", "v1")
DIGEST = [""]  # the base model's config digest, set when the control plane starts
OTHER_MODEL = "0" * 64  # the config digest of a base model this control plane does not serve
pytestmark = pytest.mark.timeout(120)


class FakeWorker(pb_grpc.InferenceServiceServicer):
    """Answers Generate with one chunk and counts the calls it saw."""

    def __init__(self, worker_id: str) -> None:
        self.worker_id, self.calls, self.port = worker_id, 0, 0
        self.server: grpc.aio.Server | None = None

    async def Generate(self, request: pb.GenerateRequest, context: grpc.aio.ServicerContext
                       ) -> AsyncIterator[pb.GenerateResponse]:
        self.calls += 1
        yield pb.GenerateResponse(chunk=pb.Chunk(token_ids=[1], text=self.worker_id))
        yield pb.GenerateResponse(complete=pb.Complete(
            finish_reason="length", served_by=pb.ServedBy(worker_id=self.worker_id)))

    async def start(self) -> None:
        handle = await start_server(
            "127.0.0.1:0", lambda s: pb_grpc.add_InferenceServiceServicer_to_server(self, s),
            [SERVICE])
        self.port, self.server = handle.port, handle.server


async def watch(cp: str, worker_id: str, address: str, metadata: tuple[tuple[str, str], ...],
                load: float, resident: list[tuple[str, str]],
                connected: asyncio.Event | None = None,
                config_sha256: str | None = None) -> grpc.StatusCode | None:
    """A worker's placement watch: hello, then heartbeats and acks until the stream ends; its
    code, or None when grpc lost it (cp_support.status_lost). Heartbeats start once the stream
    is accepted (its first update): a write in flight as the control plane refuses the hello
    is what loses a refusal's code."""
    outbox: asyncio.Queue[ppb.WorkerMessage] = asyncio.Queue()
    outbox.put_nowait(ppb.WorkerMessage(hello=ppb.WorkerHello(
        worker_id=worker_id, address=address, capacity=4, base_model=BASE,
        config_sha256=DIGEST[0] if config_sha256 is None else config_sha256)))

    async def messages() -> AsyncIterator[ppb.WorkerMessage]:
        while True:
            yield await outbox.get()

    async def heartbeats() -> None:
        keys = [ppb.VersionKey(adapter_id=a, version=v) for a, v in resident]
        while True:
            outbox.put_nowait(ppb.WorkerMessage(heartbeat=ppb.Heartbeat(
                load=load, resident=keys, started_at_ms=1)))
            await asyncio.sleep(0.1)

    beats: asyncio.Task[None] | None = None
    try:
        async with grpc.aio.insecure_channel(cp) as channel:
            call = ppb_grpc.PlacementServiceStub(channel).WatchPlacement(
                messages(), metadata=metadata)
            async for update in call:
                beats = beats or asyncio.create_task(heartbeats())
                outbox.put_nowait(ppb.WorkerMessage(ack=ppb.Ack(revision=update.revision)))
                if connected is not None:
                    connected.set()
            return grpc.StatusCode.OK
    except grpc.aio.AioRpcError as exc:
        return None if status_lost(exc) else exc.code()
    finally:
        if beats is not None:
            beats.cancel()


async def refusal(cp: str, worker_id: str, address: str, token: str,
                  config_sha256: str | None = None) -> grpc.StatusCode | None:
    """The code an attacker's watch (load 0, every version warm) ends with; asked again when
    grpc lost it. The hello alone can still be in flight when the credential is refused."""
    for _ in range(3):
        code = await asyncio.wait_for(watch(cp, worker_id, address, cluster_metadata(token),
                                            load=0.0, resident=[ADAPTER],
                                            config_sha256=config_sha256), 10)
        if code is not None:
            return code
    return None


async def start_plane(db_url: str, base_model_dir: Path, adapter_root: Path) -> ControlPlane:
    sessions = make_session_factory(make_engine(db_url))
    plane = await build_server(ControlPlaneConfig(
        db_url=db_url, listen="127.0.0.1:0", base_models={BASE: base_model_dir},
        storage=StorageConfig(allowed_roots=(adapter_root,)), max_rank=MAX_RANK,
        cluster_token=TOKEN), sessions)
    # 25 missed heartbeats (5 s): a loaded host can stall the honest worker's heartbeats past
    # 0.6 s, and a worker marked down is replaced, not refused as a duplicate (ALREADY_EXISTS).
    DIGEST[0] = config_digest(base_model_dir)
    hub = attach_placement(plane.server, sessions,
                           HubConfig(poll_s=0.05, heartbeat_s=0.2, missed_heartbeats=25),
                           credentials=plane.credentials, base_models={BASE: DIGEST[0]})
    await plane.server.start()
    plane.hub_task = asyncio.create_task(hub.run())  # type: ignore[attr-defined]
    return plane


def publish(plane: ControlPlane, adapter_root: Path) -> str:
    """Tenant acme with the stable adapter sec/bot v1; returns a tenant key."""
    plane.keys.create_tenant("acme", SYSTEM)
    good = adapter_root / "good" / "v1"
    plane.registry.register_version(RegisterRequest(
        *ADAPTER, good.as_uri(), digest_adapter_dir(good), BASE, "acme"), SYSTEM)
    etag = plane.registry.get_adapter(ADAPTER[0], SYSTEM).route.etag
    plane.registry.promote(*ADAPTER, etag, SYSTEM)
    return plane.keys.create_key("tenant", "acme", "client", SYSTEM)[1]


async def start_gateway(cp: str
                        ) -> tuple[grpc.aio.Server, int, RoutingTable, asyncio.Task[None]]:
    table, metrics = RoutingTable(), GatewayMetrics()
    router = Router(table, metrics)
    servicer = GatewayServicer(router)
    handle = await start_server(
        "127.0.0.1:0", lambda s: pb_grpc.add_InferenceServiceServicer_to_server(servicer, s),
        [SERVICE])
    synced = asyncio.Event()
    task = asyncio.create_task(RoutingWatcher(cp, "gw-1", table, metrics, synced,
                                              cluster_token=TOKEN).run())
    await asyncio.wait_for(synced.wait(), 10)
    return handle.server, handle.port, table, task


async def until(predicate: object, seconds: float = 10.0) -> None:
    async def poll() -> None:
        while not predicate():  # type: ignore[operator]
            await asyncio.sleep(0.05)
    await asyncio.wait_for(poll(), seconds)


def assigned_to_honest(other: str) -> bool:
    """Whether the planner gives sec/bot to w-honest rather than to `other` beside it
    (ids sort before w-honest, so a tie on everything else would favour them)."""
    slots = [WorkerSlot("w-honest", 4), WorkerSlot(other, 4)]
    return ADAPTER in plan([ADAPTER], slots, set(), PlannerConfig()).get("w-honest", {})


async def scenario(db_url: str, base_model_dir: Path, adapter_root: Path) -> None:
    plane = await start_plane(db_url, base_model_dir, adapter_root)
    cp = f"127.0.0.1:{plane.port}"
    api_key = await asyncio.to_thread(publish, plane, adapter_root)
    honest_credential = plane.credentials.mint("w-honest", SYSTEM, base_model=BASE)
    other_credential = plane.credentials.mint("w-other", SYSTEM)
    # A compromised worker: a valid credential (bound to the base model), an id the planner
    # does not assign sec/bot to beside w-honest.
    comp_id = next(f"w-comp-{i}" for i in range(100) if assigned_to_honest(f"w-comp-{i}"))
    comp_credential = plane.credentials.mint(comp_id, SYSTEM, base_model=BASE)
    honest, evil, comp = FakeWorker("w-honest"), FakeWorker("w-evil"), FakeWorker(comp_id)
    for w in (honest, evil, comp):
        await w.start()
    connected = asyncio.Event()
    honest_watch = asyncio.create_task(watch(
        cp, "w-honest", f"127.0.0.1:{honest.port}", cluster_metadata(honest_credential),
        load=0.9, resident=[], connected=connected))
    await asyncio.wait_for(connected.wait(), 10)

    # The attacker: the cluster token, load 0 and every version warm; then stolen or
    # mismatched credentials.
    evil_address = f"127.0.0.1:{evil.port}"
    attempts = {
        ("w-evil", TOKEN): grpc.StatusCode.UNAUTHENTICATED,
        ("w-honest", TOKEN): grpc.StatusCode.UNAUTHENTICATED,
        ("w-honest", other_credential): grpc.StatusCode.PERMISSION_DENIED,
        ("w-honest", honest_credential): grpc.StatusCode.ALREADY_EXISTS,  # duplicate live id
        ("../w", other_credential): grpc.StatusCode.INVALID_ARGUMENT,
    }
    for (worker_id, token), code in attempts.items():
        got = await refusal(cp, worker_id, evil_address, token)
        assert got == code, (worker_id, got)
    # A credential bound to the base model, or an unbound one, with another model's config.
    for worker_id, token in ((comp_id, comp_credential), ("w-other", other_credential)):
        got = await refusal(cp, worker_id, evil_address, token, config_sha256=OTHER_MODEL)
        assert got == grpc.StatusCode.PERMISSION_DENIED, (worker_id, got)

    # The compromised worker joins with its valid credential and lies: load 0, every version
    # warm. Traffic follows the control plane's assignment (sec/bot: w-honest), not claims.
    comp_connected = asyncio.Event()
    comp_watch = asyncio.create_task(watch(
        cp, comp_id, f"127.0.0.1:{comp.port}", cluster_metadata(comp_credential),
        load=0.0, resident=[ADAPTER], connected=comp_connected))
    await asyncio.wait_for(comp_connected.wait(), 10)
    gateway, port, table, gateway_task = await start_gateway(cp)
    await until(lambda: set(table.workers) == {"w-honest", comp_id})
    # The key reaches gateways with the control plane's next registry poll (every 0.2 s); a
    # gateway that connected before it gets it as a delta.
    await until(lambda: token_sha256(api_key) in table.keys)
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
        stub = pb_grpc.InferenceServiceStub(channel)
        for i in range(40):
            request = pb.GenerateRequest(text="hi", routing_key=str(i),
                                         adapter=pb.AdapterRef(adapter_id=ADAPTER[0]))
            replies = [r async for r in stub.Generate(
                request, metadata=cluster_metadata(api_key), timeout=10)]
            assert replies[-1].complete.served_by.worker_id == "w-honest"
    assert (honest.calls, evil.calls, comp.calls) == (40, 0, 0)
    comp_watch.cancel()

    # Revocation closes the live stream (OK, or lost to a heartbeat in flight), and gateways
    # stop routing to the worker.
    plane.credentials.revoke("w-honest", SYSTEM)
    assert await asyncio.wait_for(honest_watch, 10) in (grpc.StatusCode.OK, None)
    await until(lambda: "w-honest" not in table.workers or not table.workers["w-honest"].up)
    got = await refusal(cp, "w-honest", evil_address, honest_credential)
    assert got == grpc.StatusCode.UNAUTHENTICATED

    gateway_task.cancel()
    plane.hub_task.cancel()  # type: ignore[attr-defined]
    for server in (gateway, honest.server, evil.server, comp.server):
        assert server is not None
        await server.stop(0)
    await plane.stop(0)


def test_only_credentialed_workers_get_calls(empty_db: str, base_model_dir: Path,
                                             adapter_root: Path) -> None:
    upgrade(empty_db)
    asyncio.run(scenario(empty_db, base_model_dir, adapter_root))
