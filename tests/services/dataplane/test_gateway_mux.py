"""The gateway's worker calls over GenerateMux (services/gateway/mux.py, services/worker/mux.py):
one stream per worker carries every request, and each request behaves as its per-call Generate
would: same outputs, its own errors, a cancel that frees it on the worker, UNAVAILABLE (and a
resumed stream) when the mux breaks. Scripted workers on real gRPC servers (gateway_harness.py),
and one real worker process."""

from __future__ import annotations

import asyncio
from pathlib import Path

import grpc
import pytest

from services.common import errors as e
from services.common.hop_auth import GATEWAY_HEADER, GATEWAY_TOKEN_ENV, GatewayOnlyInterceptor
from services.common.server import start_server
from services.gateway import mux as mux_module
from services.gateway.metrics import GatewayMetrics
from services.gateway.router import Router
from slora.v1 import inference_pb2 as pb
from slora.v1 import inference_pb2_grpc as pb_grpc
from tests.services.dataplane.dp_support import PROMPTS, request, scrape, scrape_when_idle
from tests.services.dataplane.gateway_harness import (
    TOKEN,
    Outcome,
    ScriptedWorker,
    expected_output,
    run_call,
    same_outcome,
    started,
    stop_all,
    table_for,
)


def ids_request(prompt: list[int], max_new_tokens: int, **extra: object) -> pb.GenerateRequest:
    return pb.GenerateRequest(token_ids=pb.TokenIds(ids=prompt),
                              sampling=pb.SamplingOptions(max_new_tokens=max_new_tokens),
                              **extra)  # type: ignore[arg-type]


async def until(predicate: object, seconds: float = 5.0) -> None:
    async def poll() -> None:
        while not predicate():  # type: ignore[operator]
            await asyncio.sleep(0.01)
    await asyncio.wait_for(poll(), seconds)


def test_concurrent_streams_over_one_mux_equal_the_per_call_path() -> None:
    async def scenario() -> None:
        prompts = [[i, i + 1, i * 7 % 13] for i in range(24)]
        outcomes: dict[bool, list[Outcome]] = {}
        for mux in (True, False):
            router, workers = await started("w1", mux=mux)
            workers[0].delay_s = 0.001  # streams interleave on the mux
            try:
                outcomes[mux] = await asyncio.gather(*(
                    run_call(router, ids_request(p, 5 + i % 9)) for i, p in enumerate(prompts)))
                assert workers[0].muxes == (1 if mux else 0)
            finally:
                await stop_all(router, workers)
        for i, (muxed, per_call) in enumerate(zip(outcomes[True], outcomes[False], strict=True)):
            assert same_outcome(muxed, per_call)
            assert muxed.token_ids == expected_output(prompts[i], 5 + i % 9)

    asyncio.run(scenario())


def test_auto_upstream_calls_per_request_until_enough_streams_are_in_flight() -> None:
    """`--upstream auto` (Upstreams.mux_from): the first 4 concurrent requests to a worker go
    as Generate calls, the rest over one mux, and every stream gets its own output."""
    async def scenario() -> None:
        prompts = [[i, i + 2, i * 5 % 11] for i in range(12)]
        router, workers = await started("w1", mux=True, mux_from=4)
        workers[0].delay_s = 0.02  # every stream still runs when the last one opens
        try:
            outcomes = await asyncio.gather(*(run_call(router, ids_request(p, 5))
                                              for p in prompts))
            assert (workers[0].generates, workers[0].muxes, len(workers[0].calls)) == (4, 1, 12)
            # Alone on the worker again: per call.
            assert (await run_call(router, ids_request(prompts[0], 3))).error is None
            assert workers[0].generates == 5 and workers[0].muxes == 1
        finally:
            await stop_all(router, workers)
        for p, out in zip(prompts, outcomes, strict=True):
            assert out.error is None and out.token_ids == expected_output(p, 5)

    asyncio.run(scenario())


def test_a_cancelled_stream_is_freed_on_the_worker_and_the_others_go_on() -> None:
    async def scenario() -> None:
        router, workers = await started("w1", mux=True)
        worker = workers[0]
        worker.delay_s = 0.01
        try:
            first_token = asyncio.Event()

            async def cancelled_one() -> None:
                async for _ in router.call(ids_request([9, 9], 500), TOKEN):
                    first_token.set()

            doomed = asyncio.create_task(cancelled_one())
            others = [asyncio.create_task(run_call(router, ids_request([i], 30)))
                      for i in range(3)]
            await first_token.wait()
            assert worker.active == 4
            doomed.cancel()
            await until(lambda: worker.active == 3)  # freed at once, not at its end
            for i, out in enumerate(await asyncio.gather(*others)):
                assert out.error is None and out.token_ids == expected_output([i], 30)
            assert worker.muxes == 1 and router.inflight["w1"] == 0
        finally:
            await stop_all(router, workers)

    asyncio.run(scenario())


def test_a_stream_error_reaches_that_stream_only_with_its_code_and_metadata() -> None:
    bad_prompt, busy_prompt = [666], [777]

    def fail(req: pb.GenerateRequest, pos: int) -> e.ServiceError | None:
        ids = list(req.token_ids.ids)
        if ids == bad_prompt and pos == 2:
            return e.InvalidArgument("token id out of range", deterministic=True)
        if ids == busy_prompt and pos == 0:
            return e.ResourceExhausted("queue full", retry_after_ms=1234)
        return None

    async def scenario() -> None:
        router, workers = await started("w1", mux=True)
        workers[0].fail_with = fail
        workers[0].delay_s = 0.001
        try:
            bad, busy, *good = await asyncio.gather(
                run_call(router, ids_request(bad_prompt, 10)),
                run_call(router, ids_request(busy_prompt, 10)),
                *(run_call(router, ids_request([i], 12)) for i in range(4)))
            assert bad.error is not None and bad.error.code == grpc.StatusCode.INVALID_ARGUMENT
            assert bad.token_ids == expected_output(bad_prompt, 2)
            assert "token id out of range" in str(bad.error)
            # Not retried: a deterministic error reaches the client at once.
            assert sum(list(c.token_ids.ids) == bad_prompt for c in workers[0].calls) == 1
            assert busy.error is not None
            assert busy.error.code == grpc.StatusCode.RESOURCE_EXHAUSTED
            assert busy.error.retry_after_ms == 1234  # carried as per-call's trailing metadata
            for i, out in enumerate(good):
                assert out.error is None and out.token_ids == expected_output([i], 12)
            assert workers[0].muxes == 1  # the mux outlived the failed streams
        finally:
            await stop_all(router, workers)

    asyncio.run(scenario())


def test_a_worker_that_dies_mid_stream_fails_its_mux_and_the_streams_resume() -> None:
    async def scenario() -> None:
        router, workers = await started("w1", "w2", mux=True)
        for w in workers:
            w.delay_s = 0.005
        try:
            calls = [asyncio.create_task(run_call(router, ids_request([i, 5], 40)))
                     for i in range(6)]
            dying, survivor = workers
            await until(lambda: dying.active + survivor.active == 6 and dying.active > 0)
            await asyncio.sleep(0.05)  # some tokens out
            in_flight = dying.active
            assert dying.server is not None
            await dying.server.server.stop(grace=None)  # the process dies: its mux breaks
            for i, out in enumerate(await asyncio.gather(*calls)):
                assert out.error is None, out.error
                assert out.token_ids == expected_output([i, 5], 40)
            assert sum(bool(c.resume_token_ids) for c in survivor.calls) == in_flight
            assert router.metrics.resumed._value.get() == in_flight
        finally:
            await stop_all(router, workers)

    asyncio.run(scenario())


def test_the_caller_deadline_ends_a_muxed_stream_and_frees_it() -> None:
    async def scenario() -> None:
        router, workers = await started("w1", mux=True)
        workers[0].delay_s = 0.01
        try:
            out = Outcome()
            try:
                async for r in router.call(ids_request([1], 1000), TOKEN, timeout_s=0.3):
                    out.token_ids += list(r.chunk.token_ids)
            except e.ServiceError as err:
                out.error = err
            assert out.error is not None
            assert out.error.code == grpc.StatusCode.DEADLINE_EXCEEDED
            assert 0 < len(out.token_ids) < 1000
            await until(lambda: workers[0].active == 0)
            # The mux serves the next request.
            after = await run_call(router, ids_request([2], 3))
            assert after.error is None and workers[0].muxes == 1
        finally:
            await stop_all(router, workers)

    asyncio.run(scenario())


class _PerCallOnly(pb_grpc.InferenceServiceServicer):
    """A worker of a version before GenerateMux: the gateway calls it per request."""

    async def Generate(self, request: pb.GenerateRequest, context: grpc.aio.ServicerContext):  # type: ignore[no-untyped-def]
        yield pb.GenerateResponse(chunk=pb.Chunk(token_ids=[7], text="old"))
        yield pb.GenerateResponse(complete=pb.Complete(finish_reason="length"))


async def older_worker_scenario(requests: int) -> None:
    handle = await start_server(
        "127.0.0.1:0",
        lambda s: pb_grpc.add_InferenceServiceServicer_to_server(_PerCallOnly(), s),
        ["slora.v1.InferenceService"])
    old = ScriptedWorker("old", address=f"127.0.0.1:{handle.port}")
    router = Router(table_for([old]), GatewayMetrics(), mux_from=0)
    try:
        for _ in range(requests):
            out = await run_call(router, ids_request([1], 4))
            assert out.error is None and out.token_ids == [7], out
    finally:
        await router.upstreams.close()
        await handle.server.stop(0)


def test_a_worker_without_the_mux_is_called_per_request() -> None:
    asyncio.run(older_worker_scenario(3))


@pytest.mark.slow
def test_a_worker_without_the_mux_is_served_in_every_one_of_many_starts() -> None:
    """The first request to an older worker raced grpc/grpc#36066 (INTERNAL for its
    UNIMPLEMENTED) in about 1 start in 110 on this machine: 1,500 starts, none may fail."""
    for _ in range(1500):
        asyncio.run(older_worker_scenario(2))


class _LostStatus(_PerCallOnly):
    """A mux that ends INTERNAL before its first down-frame: what grpc.aio's client reads
    when its first write races the UNIMPLEMENTED of a worker without the mux
    (grpc/grpc#36066)."""

    def __init__(self) -> None:
        self.muxes = 0

    async def GenerateMux(self, request_iterator, context: grpc.aio.ServicerContext):  # type: ignore[no-untyped-def]
        self.muxes += 1
        await context.abort(grpc.StatusCode.INTERNAL, "Internal error from Core")
        yield pb.MuxDown()  # never reached: makes this a stream handler


def test_a_mux_that_ends_internal_before_any_frame_sends_its_streams_per_call() -> None:
    async def scenario() -> None:
        servicer = _LostStatus()
        handle = await start_server(
            "127.0.0.1:0",
            lambda s: pb_grpc.add_InferenceServiceServicer_to_server(servicer, s),
            ["slora.v1.InferenceService"])
        worker = ScriptedWorker("w", address=f"127.0.0.1:{handle.port}")
        router = Router(table_for([worker]), GatewayMetrics(), mux_from=0)
        try:
            for i in range(3):
                out = await run_call(router, ids_request([1], 4))
                assert out.error is None and out.token_ids == [7], out
                # Not marked as a worker without the mux: each request tries it again.
                assert servicer.muxes == i + 1
        finally:
            await router.upstreams.close()
            await handle.server.stop(0)

    asyncio.run(scenario())


def test_a_mux_without_the_gateway_token_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    token = "slg_test-mux-token"
    monkeypatch.setenv(GATEWAY_TOKEN_ENV, token)

    async def scenario() -> None:
        worker = ScriptedWorker("w1")
        handle = await started_with_interceptor(worker, token)
        try:
            async with grpc.aio.insecure_channel(worker.address) as channel:
                for metadata in ((), ((GATEWAY_HEADER, token + "x"),)):
                    call = pb_grpc.InferenceServiceStub(channel).GenerateMux(metadata=metadata)
                    # Refused on the call's metadata, before any frame: read without writing.
                    # A write racing the refusal can make grpc.aio's client read INTERNAL
                    # instead (grpc/grpc#36066: 88 of 6,000 here), which the gateway's mux
                    # handles by going per call (test above).
                    with pytest.raises(grpc.aio.AioRpcError) as refused:
                        async for _ in call:
                            pass
                    assert refused.value.code() == grpc.StatusCode.UNAUTHENTICATED
                    with pytest.raises(asyncio.InvalidStateError):  # nothing more goes up
                        await call.write(pb.MuxUp(requests=[pb.MuxRequest(
                            stream_id=1, request=ids_request([1], 3))]))
            assert worker.calls == [] and worker.muxes == 0
            # The gateway's channels (WorkerChannels) present the token on the mux as on
            # every call.
            router = Router(table_for([worker]), GatewayMetrics(), mux_from=0)
            out = await run_call(router, ids_request([1], 3))
            assert out.error is None and worker.muxes == 1
            await router.upstreams.close()
        finally:
            await handle.server.stop(0)

    asyncio.run(scenario())


async def started_with_interceptor(worker: ScriptedWorker, token: str):  # type: ignore[no-untyped-def]
    """`worker` served behind the workers' gateway-token interceptor."""
    from tests.services.dataplane.gateway_harness import SERVICE, _Servicer

    servicer = _Servicer(worker)
    handle = await start_server(
        "127.0.0.1:0", lambda s: pb_grpc.add_InferenceServiceServicer_to_server(servicer, s),
        [SERVICE], interceptors=[GatewayOnlyInterceptor(token)])
    worker.server, worker.address = handle, f"127.0.0.1:{handle.port}"
    return handle


def test_a_real_worker_over_the_mux(demo_dir: Path, tmp_path: Path) -> None:
    """The worker's GenerateMux runs Generate's own per-request path: the same greedy outputs
    as per call, a bad request failing alone, and a cancel freeing the request in the core."""
    from services.worker.debug_hooks import STEP_DELAY_ENV
    from tests.services.dataplane.test_worker_faults import start_worker

    # 5 ms steps (a test hook): the long request is surely mid-generation when cancelled.
    worker, address, metrics_port, _ = start_worker(demo_dir, tmp_path,
                                                    env={STEP_DELAY_ENV: "0.005"})
    real = ScriptedWorker("real", address=address)

    def greedy(i: int) -> pb.GenerateRequest:
        return request(PROMPTS[i % len(PROMPTS)], max_new_tokens=6 + i, ignore_eos=True,
                       temperature=0)

    async def scenario() -> None:
        routers = {mux: Router(table_for([real]), GatewayMetrics(),
                                mux_from=0 if mux else None)
                   for mux in (True, False)}
        try:
            outs = {mux: await asyncio.gather(*(run_call(r, greedy(i)) for i in range(4)))
                    for mux, r in routers.items()}
            for muxed, per_call in zip(outs[True], outs[False], strict=True):
                assert same_outcome(muxed, per_call) and muxed.token_ids
            bad = ids_request([1, 10**6], 4)  # a token id past the vocabulary
            bad_out, good = await asyncio.gather(run_call(routers[True], bad),
                                                 run_call(routers[True], greedy(0)))
            assert bad_out.error is not None
            assert bad_out.error.code == grpc.StatusCode.INVALID_ARGUMENT
            assert good.error is None and good.token_ids == outs[False][0].token_ids
            aborted = scrape(metrics_port).get("slora_requests_aborted_total", 0.0)
            first = asyncio.Event()

            async def long_one() -> None:
                long = request(PROMPTS[1], max_new_tokens=400, ignore_eos=True)
                async for _ in routers[True].call(long, TOKEN):
                    first.set()

            task = asyncio.create_task(long_one())
            await asyncio.wait([task, asyncio.create_task(first.wait())], timeout=60,
                               return_when=asyncio.FIRST_COMPLETED)
            assert first.is_set() and not task.done()
            task.cancel()
            idle, m = await asyncio.to_thread(scrape_when_idle, metrics_port, 30.0)
            assert idle, m
            assert m["slora_requests_aborted_total"] == aborted + 1
        finally:
            for r in routers.values():
                await r.upstreams.close()

    try:
        asyncio.run(scenario())
    finally:
        worker.kill()


def test_large_requests_are_split_across_up_frames_and_one_bigger_than_a_frame_goes_per_call(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Requests gathered for one up-frame that together pass the worker's 4 MiB receive limit
    go in several frames (one frame over it would end the mux and every stream on it); a
    request bigger than a frame (possible only with limits above the defaults) goes per call."""
    # About 0.4 MB each (4-byte varints), 7 MB together; the gateway's limit is 131,072 ids.
    prompts = [[3_000_000 + 7 * i + j for j in range(100_000)] for i in range(18)]

    async def scenario() -> None:
        router, workers = await started("w1", mux=True)
        try:
            outcomes = await asyncio.gather(*(run_call(router, ids_request(p, 2))
                                              for p in prompts))
            for p, out in zip(prompts, outcomes, strict=True):
                assert out.error is None, out.error
                assert out.token_ids == expected_output(p, 2)
            # One mux carried them all and never broke; nothing went per call.
            assert workers[0].muxes == 1 and workers[0].generates == 0
            assert len(workers[0].calls) == len(prompts)

            monkeypatch.setattr(mux_module, "MAX_UP_FRAME_BYTES", 256 * 1024)
            small = [1, 2, 3]
            big, other = await asyncio.gather(run_call(router, ids_request(prompts[0], 2)),
                                              run_call(router, ids_request(small, 2)))
            assert big.error is None and big.token_ids == expected_output(prompts[0], 2)
            assert other.error is None and other.token_ids == expected_output(small, 2)
            assert workers[0].generates == 1 and workers[0].muxes == 1
        finally:
            await stop_all(router, workers)

    asyncio.run(scenario())


def test_an_idle_mux_is_closed_and_the_next_request_opens_another(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(mux_module, "MUX_IDLE_CLOSE_S", 0.5)

    async def scenario() -> None:
        router, workers = await started("w1", mux=True)
        worker = workers[0]
        try:
            for _ in range(2):  # a stream ending and one opening within the idle time
                out = await run_call(router, ids_request([1, 2], 3))
                assert out.error is None and out.token_ids == expected_output([1, 2], 3)
            assert worker.muxes == 1 and worker.open_muxes == 1
            await until(lambda: worker.open_muxes == 0, 5.0)  # idle: closed on both ends
            out = await run_call(router, ids_request([3], 3))
            assert out.error is None and out.token_ids == expected_output([3], 3)
            assert worker.muxes == 2 and worker.open_muxes == 1
        finally:
            await stop_all(router, workers)

    asyncio.run(scenario())
