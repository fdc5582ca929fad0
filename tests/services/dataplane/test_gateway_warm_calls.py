"""The gateway's idle worker calls (`--upstream warm`: services/gateway/upstream.py WarmCalls,
the worker's GenerateOpen): a request goes as the first message on a call opened before it
came, and behaves as its per-call Generate would: same outputs, its own errors, a cancel and a
deadline that free it on the worker; a worker that ended the idle calls (restart) still gets
its requests (one without GenerateOpen: test_gateway_mux.py). Scripted workers on real gRPC
servers (gateway_harness.py), and one real worker process."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import grpc
import pytest

from services.common import errors as e
from services.common.server import start_server
from services.gateway.metrics import GatewayMetrics
from services.gateway.router import Router
from slora.v1 import inference_pb2 as pb
from slora.v1 import inference_pb2_grpc as pb_grpc
from tests.services.dataplane.dp_support import PROMPTS, request
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
from tests.services.dataplane.test_gateway_mux import ids_request, until


def test_requests_on_idle_calls_equal_the_per_call_path() -> None:
    async def scenario() -> None:
        prompts = [[i, i + 1, i * 7 % 13] for i in range(16)]
        outcomes: dict[bool, list[Outcome]] = {}
        for warm in (True, False):
            router, workers = await started("w1", warm=3 if warm else 0)
            worker = workers[0]
            try:
                outcomes[warm] = []
                for i, p in enumerate(prompts):  # one at a time: the pool refills between
                    outcomes[warm].append(await run_call(router, ids_request(p, 3 + i % 5)))
                if warm:
                    # The first request found no idle call (the pool starts filling then); every
                    # later one went on an idle call, and 3 stay open.
                    assert (worker.generates, worker.served_open) == (1, 15)
                    await until(lambda w=worker: w.opened == 18)
                else:
                    assert (worker.generates, worker.opened) == (16, 0)
            finally:
                await stop_all(router, workers)
        for i, (warm, per_call) in enumerate(zip(outcomes[True], outcomes[False], strict=True)):
            assert same_outcome(warm, per_call)
            assert warm.token_ids == expected_output(prompts[i], 3 + i % 5)

    asyncio.run(scenario())


def test_a_burst_takes_the_idle_calls_and_the_rest_go_per_call() -> None:
    async def scenario() -> None:
        router, workers = await started("w1", warm=4)
        worker = workers[0]
        worker.delay_s = 0.005
        try:
            assert (await run_call(router, ids_request([5], 2))).error is None  # fills the pool
            await until(lambda: worker.opened == 4)
            prompts = [[i, 3] for i in range(12)]
            outs = await asyncio.gather(*(run_call(router, ids_request(p, 6)) for p in prompts))
            for p, out in zip(prompts, outs, strict=True):
                assert out.error is None and out.token_ids == expected_output(p, 6)
            # The 4 idle calls took the first 4; a call taken is replaced at its first answer,
            # so of the rest, those that came before went per call.
            assert worker.served_open >= 4 and worker.served_open + worker.generates == 13
            assert router.inflight["w1"] == 0
        finally:
            await stop_all(router, workers)

    asyncio.run(scenario())


def test_a_stream_error_on_an_idle_call_keeps_its_code_and_metadata() -> None:
    async def scenario() -> None:
        router, workers = await started("w1", warm=2)

        def fail(req: pb.GenerateRequest, pos: int) -> e.ServiceError | None:
            if list(req.token_ids.ids) == [666] and pos == 2:
                return e.InvalidArgument("token 666 is refused")
            return None

        workers[0].fail_with = fail
        try:
            await run_call(router, ids_request([1], 2))  # fills the pool
            bad, good = await asyncio.gather(run_call(router, ids_request([666], 5)),
                                             run_call(router, ids_request([2], 5)))
            assert bad.error is not None and bad.error.code == grpc.StatusCode.INVALID_ARGUMENT
            assert "token 666 is refused" in str(bad.error)
            assert good.error is None and good.token_ids == expected_output([2], 5)
            assert workers[0].served_open == 2
        finally:
            await stop_all(router, workers)

    asyncio.run(scenario())


def test_a_cancel_and_a_deadline_free_the_request_on_the_worker() -> None:
    async def scenario() -> None:
        router, workers = await started("w1", warm=2)
        worker = workers[0]
        worker.delay_s = 0.01
        try:
            await run_call(router, ids_request([1], 1))  # fills the pool
            first_token = asyncio.Event()

            async def cancelled_one() -> None:
                async for _ in router.call(ids_request([9, 9], 500), TOKEN):
                    first_token.set()

            doomed = asyncio.create_task(cancelled_one())
            await first_token.wait()
            assert worker.active == 1 and worker.served_open == 1
            doomed.cancel()
            await until(lambda: worker.active == 0)  # freed at once, not at its end
            out = Outcome()
            try:
                async for r in router.call(ids_request([3], 1000), TOKEN, timeout_s=0.3):
                    out.token_ids += list(r.chunk.token_ids)
            except e.ServiceError as err:
                out.error = err
            assert out.error is not None
            assert out.error.code == grpc.StatusCode.DEADLINE_EXCEEDED
            assert 0 < len(out.token_ids) < 1000 and worker.served_open == 2
            await until(lambda: worker.active == 0)
        finally:
            await stop_all(router, workers)

    asyncio.run(scenario())


class _Stuck(pb_grpc.InferenceServiceServicer):
    """A worker that takes the request on an idle call and never answers (nor keeps its
    deadline): the gateway's own deadline must end the stream."""

    def __init__(self) -> None:
        self.cancelled = asyncio.Event()

    async def GenerateOpen(self, request_iterator, context):  # type: ignore[no-untyped-def]
        await anext(aiter(request_iterator), None)
        try:
            await asyncio.sleep(3600)
        except asyncio.CancelledError:
            self.cancelled.set()
            raise
        yield pb.GenerateResponse()


def test_the_gateway_keeps_the_deadline_of_a_request_on_an_idle_call() -> None:
    async def scenario() -> None:
        stuck = _Stuck()
        handle = await start_server(
            "127.0.0.1:0", lambda s: pb_grpc.add_InferenceServiceServicer_to_server(stuck, s),
            ["slora.v1.InferenceService"])
        worker = ScriptedWorker("stuck", address=f"127.0.0.1:{handle.port}")
        router = Router(table_for([worker]), GatewayMetrics(), warm=2)
        warm = router.upstreams.warm
        assert warm is not None
        try:
            warm.refill(worker.address)
            await asyncio.sleep(0.2)  # the idle calls open
            t0 = time.monotonic()
            with pytest.raises(e.ServiceError) as err:
                async for _ in router.call(ids_request([1], 4), TOKEN, timeout_s=0.3):
                    pass
            assert err.value.code == grpc.StatusCode.DEADLINE_EXCEEDED
            assert time.monotonic() - t0 < 2.0
            await asyncio.wait_for(stuck.cancelled.wait(), 5)  # the worker's call cancelled
        finally:
            await router.upstreams.close()
            await handle.server.stop(0)

    asyncio.run(scenario())


def test_a_restarted_worker_s_ended_idle_calls_are_not_used() -> None:
    """A worker that stops ends its idle calls; the next requests, to the worker started
    again on the same address, get their outputs (none is sent on a finished call)."""
    async def scenario() -> None:
        router, workers = await started("w1", warm=3)
        first = workers[0]
        port = int(first.address.rsplit(":", 1)[1])
        again = ScriptedWorker("w1", address=first.address)
        try:
            assert (await run_call(router, ids_request([4], 3))).error is None
            await until(lambda: first.opened == 3)
            await first.stop()
            await again.start(port)
            await asyncio.sleep(0.2)  # the ended calls' status reaches the gateway
            for i in range(5):
                out = await run_call(router, ids_request([i, 8], 4))
                assert out.error is None and out.token_ids == expected_output([i, 8], 4)
            assert again.generates + again.served_open == 5
        finally:
            await router.upstreams.close()
            await again.stop()

    asyncio.run(scenario())


def test_a_real_worker_on_idle_calls(demo_dir: Path, tmp_path: Path) -> None:
    """The worker's GenerateOpen runs Generate's own per-request path: the same greedy outputs
    as per call, and a bad request failing alone; idle calls do not hold up its drain."""
    from tests.services.dataplane.test_worker_faults import start_worker

    worker, address, _, _ = start_worker(demo_dir, tmp_path)
    real = ScriptedWorker("real", address=address)

    def greedy(i: int) -> pb.GenerateRequest:
        return request(PROMPTS[i % len(PROMPTS)], max_new_tokens=5 + i, ignore_eos=True,
                       temperature=0)

    async def scenario() -> None:
        routers = {warm: Router(table_for([real]), GatewayMetrics(), warm=2 if warm else 0)
                   for warm in (True, False)}
        try:
            await run_call(routers[True], greedy(0))  # fills the pool
            await asyncio.sleep(0.2)
            outs = {warm: [await run_call(r, greedy(i)) for i in range(3)]
                    for warm, r in routers.items()}
            for warm, per_call in zip(outs[True], outs[False], strict=True):
                assert same_outcome(warm, per_call) and warm.token_ids
            bad = await run_call(routers[True], ids_request([1, 10**6], 4))  # past the vocab
            assert bad.error is not None
            assert bad.error.code == grpc.StatusCode.INVALID_ARGUMENT
            # The gateway's idle calls hold no drain: the worker stops well within its 30 s
            # grace (they end at the server's stop).
            await asyncio.sleep(0.2)
            t0 = time.monotonic()
            assert await asyncio.to_thread(worker.stop, 30.0) == 0
            assert time.monotonic() - t0 < 15
        finally:
            for r in routers.values():
                await r.upstreams.close()

    try:
        asyncio.run(scenario())
    finally:
        worker.kill()
