"""An in-process gateway routing path (the real `Router`, a hand-built routing table) in front
of scripted workers on real gRPC servers: for tests of what the gateway does with a worker's
answers (retries, deterministic errors, resuming a broken stream) in milliseconds.

A `ScriptedWorker` generates greedily from a fixed rule: the next token is a function of every
token before it (prompt and output), so a stream resumed from any point on another scripted
worker continues exactly as the uninterrupted one, as a real greedy model does."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator, AsyncIterator, Callable
from dataclasses import dataclass, field

import grpc

from services.common import errors as e
from services.common.server import GrpcServer, start_server
from services.gateway.metrics import GatewayMetrics
from services.gateway.router import Router
from services.gateway.table import RoutingTable, token_sha256
from services.worker.mux import MuxSession
from slora.v1 import inference_pb2 as pb
from slora.v1 import inference_pb2_grpc as pb_grpc
from slora.v1 import placement_pb2 as ppb

TOKEN = "slk_harness-admin-key"
VOCAB = 1000
SERVICE = pb.DESCRIPTOR.services_by_name["InferenceService"].full_name


def next_token(context: list[int]) -> int:
    """The scripted model: a deterministic function of the whole context."""
    h = 17
    for t in context:
        h = (h * 31 + t + 1) % 1_000_003
    return h % VOCAB


def prompt_tokens(request: pb.GenerateRequest) -> list[int]:
    if request.WhichOneof("input") == "token_ids":
        return list(request.token_ids.ids)
    return list(request.text.encode())


def expected_output(prompt: list[int], n: int) -> list[int]:
    context, out = list(prompt), []
    for _ in range(n):
        out.append(next_token(context))
        context.append(out[-1])
    return out


@dataclass
class ScriptedWorker:
    """One worker. `fail_with(request, position)` may return a ServiceError to end the
    stream with, before the token at `position` (0: before the first)."""

    worker_id: str
    fail_with: Callable[[pb.GenerateRequest, int], e.ServiceError | None] = (
        lambda _r, _p: None)
    calls: list[pb.GenerateRequest] = field(default_factory=list)
    delay_s: float = 0.0  # between tokens
    active: int = 0  # requests being generated now (a cancel or a broken call ends one)
    muxes: int = 0  # GenerateMux calls received
    generates: int = 0  # Generate (per-call) calls received
    open_muxes: int = 0  # GenerateMux calls not ended yet
    server: GrpcServer | None = None
    address: str = ""

    async def start(self) -> None:
        servicer = _Servicer(self)
        self.server = await start_server(
            "127.0.0.1:0", lambda s: pb_grpc.add_InferenceServiceServicer_to_server(servicer, s),
            [SERVICE])
        self.address = f"127.0.0.1:{self.server.port}"

    async def stop(self) -> None:
        if self.server is not None:
            await self.server.server.stop(grace=None)


class _Servicer(pb_grpc.InferenceServiceServicer):
    """Generate and GenerateMux over one per-request generator, as the real worker's."""

    def __init__(self, worker: ScriptedWorker) -> None:
        self.worker = worker

    async def Generate(self, request: pb.GenerateRequest, context: grpc.aio.ServicerContext,
                       ) -> AsyncIterator[pb.GenerateResponse]:
        self.worker.generates += 1
        try:
            async for r in self.serve(request, "", None):
                yield r
        except e.ServiceError as err:
            await e.abort_with(context, err)

    async def GenerateMux(self, request_iterator: AsyncIterator[pb.MuxUp],
                          context: grpc.aio.ServicerContext) -> AsyncIterator[pb.MuxDown]:
        self.worker.muxes += 1
        self.worker.open_muxes += 1
        try:
            async for frame in MuxSession(self.serve).frames(request_iterator):
                yield frame
        finally:
            self.worker.open_muxes -= 1

    async def serve(self, request: pb.GenerateRequest, _tenant: str, _timeout: float | None,
                    ) -> AsyncGenerator[pb.GenerateResponse, None]:
        self.worker.calls.append(request)
        self.worker.active += 1
        try:
            # A resumed stream (docs/failover.md): the tokens the client has, then the rest.
            resume = list(request.resume_token_ids)
            ctx = prompt_tokens(request) + resume
            for pos in range(len(resume), request.sampling.max_new_tokens):
                err = self.worker.fail_with(request, pos)
                if err is not None:
                    raise err
                tok = next_token(ctx)
                ctx.append(tok)
                yield pb.GenerateResponse(chunk=pb.Chunk(token_ids=[tok], text=f"<{tok}>"))
                await asyncio.sleep(self.worker.delay_s)
        finally:
            self.worker.active -= 1
        yield pb.GenerateResponse(complete=pb.Complete(
            finish_reason="length",
            usage=pb.Usage(prompt_tokens=len(prompt_tokens(request)),
                           completion_tokens=request.sampling.max_new_tokens),
            served_by=pb.ServedBy(adapter_id=request.adapter.adapter_id,
                                  adapter_version=request.adapter.version,
                                  worker_id=self.worker.worker_id)))


def table_for(workers: list[ScriptedWorker]) -> RoutingTable:
    """A synced table: the base model only, every worker up, one admin key (TOKEN)."""
    table = RoutingTable()
    table.apply(ppb.RoutingUpdate(
        revision=1, snapshot=True,
        workers=[ppb.WorkerEndpoint(worker_id=w.worker_id, address=w.address, up=True)
                 for w in workers],
        keys=[ppb.KeyGrant(token_sha256=token_sha256(TOKEN), key_id="k", admin=True)]))
    return table


async def started(*names: str, mux: bool = False, mux_from: int = 0,
                  ) -> tuple[Router, list[ScriptedWorker]]:
    """A router over new scripted workers; `mux`: its worker calls over GenerateMux (from
    `mux_from` streams in flight on a worker on) or one Generate call each (the gateway's
    default)."""
    workers = [ScriptedWorker(n) for n in names]
    for w in workers:
        await w.start()
    return Router(table_for(workers), GatewayMetrics(), mux_from=mux_from if mux else None), \
        workers


async def stop_all(router: Router, workers: list[ScriptedWorker]) -> None:
    await router.upstreams.close()
    for w in workers:
        await w.stop()


@dataclass
class Outcome:
    token_ids: list[int] = field(default_factory=list)
    complete: pb.Complete | None = None
    error: e.ServiceError | None = None


async def run_call(router: Router, request: pb.GenerateRequest) -> Outcome:
    out = Outcome()
    try:
        async for r in router.call(request, TOKEN):
            if r.HasField("chunk"):
                out.token_ids += list(r.chunk.token_ids)
            else:
                out.complete = r.complete
    except e.ServiceError as err:
        out.error = err
    return out


def same_outcome(a: Outcome, b: Outcome) -> bool:
    """Both answered without error, the same tokens, and a `complete` equal but for the
    request id each gateway made up."""
    assert a.error is None and b.error is None, (a.error, b.error)
    assert a.complete is not None and b.complete is not None
    a.complete.ClearField("request_id")
    b.complete.ClearField("request_id")
    return a.token_ids == b.token_ids and a.complete == b.complete
