"""The gateway -> worker hop (services.common.hop_auth): a worker with a gateway token refuses
InferenceService calls that do not carry it (UNAUTHENTICATED, the servicer never runs), serves
the gateway's worker channels (services.gateway.upstream.WorkerChannels) which add it, and
keeps health open."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from services.common.hop_auth import (
    GATEWAY_HEADER,
    GATEWAY_TOKEN_ENV,
    GatewayOnlyInterceptor,
    GatewayTokenInterceptor,
    new_gateway_token,
)
from services.common.server import start_server
from services.gateway.upstream import WorkerChannels
from slora.v1 import inference_pb2 as pb
from slora.v1 import inference_pb2_grpc as pb_grpc

TOKEN = new_gateway_token()
DENIED = grpc.StatusCode.UNAUTHENTICATED


class Worker(pb_grpc.InferenceServiceServicer):
    def __init__(self) -> None:
        self.calls = 0

    async def Generate(self, request: pb.GenerateRequest, context: grpc.aio.ServicerContext
                       ) -> AsyncIterator[pb.GenerateResponse]:
        self.calls += 1
        yield pb.GenerateResponse(chunk=pb.Chunk(text="ok"))

    async def ReportFeedback(self, request: pb.ReportFeedbackRequest,
                             context: grpc.aio.ServicerContext) -> pb.ReportFeedbackResponse:
        self.calls += 1
        return pb.ReportFeedbackResponse()


async def generate(stub: pb_grpc.InferenceServiceStub, metadata: tuple = ()) -> grpc.StatusCode:
    try:
        async for _ in stub.Generate(pb.GenerateRequest(text="x"), metadata=metadata, timeout=5):
            pass
        return grpc.StatusCode.OK
    except grpc.aio.AioRpcError as exc:
        return exc.code()


async def feedback(stub: pb_grpc.InferenceServiceStub) -> grpc.StatusCode:
    try:
        await stub.ReportFeedback(pb.ReportFeedbackRequest(request_id="r"), timeout=5)
        return grpc.StatusCode.OK
    except grpc.aio.AioRpcError as exc:
        return exc.code()


def test_workers_serve_gateways_only(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(GATEWAY_TOKEN_ENV, TOKEN)

    async def main() -> None:
        worker = Worker()
        handle = await start_server(
            "127.0.0.1:0", lambda s: pb_grpc.add_InferenceServiceServicer_to_server(worker, s),
            ["slora.v1.InferenceService"], interceptors=GatewayOnlyInterceptor.from_env())
        address = f"127.0.0.1:{handle.port}"
        try:
            async with grpc.aio.insecure_channel(address) as channel:
                stub = pb_grpc.InferenceServiceStub(channel)
                assert await generate(stub) == DENIED
                assert await generate(stub, ((GATEWAY_HEADER, TOKEN + "x"),)) == DENIED
                assert await generate(stub, (("authorization", f"Bearer {TOKEN}"),)) == DENIED
                assert await feedback(stub) == DENIED
                assert worker.calls == 0
                health = await health_pb2_grpc.HealthStub(channel).Check(
                    health_pb2.HealthCheckRequest(service=""), timeout=5)
                assert health.status == health_pb2.HealthCheckResponse.SERVING
            channels = WorkerChannels()  # the gateway's: adds the token from the environment
            assert await generate(channels.stub(address)) == grpc.StatusCode.OK
            assert await feedback(channels.stub(address)) == grpc.StatusCode.OK
            await channels.close()
            assert worker.calls == 2
        finally:
            await handle.server.stop(0)

    asyncio.run(main())


def test_without_a_token_nothing_is_installed(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(GATEWAY_TOKEN_ENV, raising=False)
    assert GatewayOnlyInterceptor.from_env() == []
    assert GatewayTokenInterceptor.from_env() == []
    with pytest.raises(ValueError):
        GatewayOnlyInterceptor("")
