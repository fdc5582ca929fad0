"""Requests that fail for a reason of their own are answered at once with that error: bad token
ids are INVALID_ARGUMENT at the gateway's edge (negative) or the worker's (past the
vocabulary), never retried as an outage; an error a worker marks deterministic (non-finite
logits, a request it cannot build) is not tried on every other worker; and a request the worker
refused leaves nothing in its engine."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import grpc
import pytest

from services.common import errors as e
from slora.v1 import inference_pb2 as pb
from slora.v1 import inference_pb2_grpc as pb_grpc
from tests.services.dataplane.dp_support import scrape_when_idle
from tests.services.dataplane.gateway_harness import run_call, started, stop_all
from tests.services.dataplane.test_worker_faults import start_worker

pytestmark = pytest.mark.timeout(120)


def ids_request(ids: list[int], max_new_tokens: int = 4) -> pb.GenerateRequest:
    return pb.GenerateRequest(token_ids=pb.TokenIds(ids=ids),
                              sampling=pb.SamplingOptions(max_new_tokens=max_new_tokens))


def test_negative_token_id_is_refused_by_the_gateway_without_calling_a_worker() -> None:
    async def scenario() -> None:
        router, workers = await started("w1", "w2")
        try:
            out = await run_call(router, ids_request([5, -1, 7]))
            assert out.error is not None and out.error.code == grpc.StatusCode.INVALID_ARGUMENT
            assert "token id -1" in str(out.error)
            assert [len(w.calls) for w in workers] == [0, 0]
            assert router.metrics.retries._value.get() == 0
        finally:
            await stop_all(router, workers)

    asyncio.run(scenario())


@pytest.mark.parametrize("deterministic", [True, False])
def test_a_deterministic_worker_error_is_not_retried(deterministic: bool) -> None:
    """The same INTERNAL error with and without the worker's mark: marked, the client gets it
    from the first worker; unmarked (a worker-local failure), the next worker serves."""
    async def scenario() -> None:
        router, workers = await started("w1", "w2")
        first = workers[0].worker_id if router.table.candidates("", "", {})[0].worker_id == \
            workers[0].worker_id else workers[1].worker_id
        for w in workers:
            if w.worker_id == first:
                w.fail_with = lambda _r, _p: e.Internal(
                    "non-finite logits (NaN or inf) for output token 0",
                    deterministic=deterministic)
        try:
            out = await run_call(router, ids_request([1, 2, 3]))
            calls = {w.worker_id: len(w.calls) for w in workers}
            if deterministic:
                assert out.error is not None and out.error.code == grpc.StatusCode.INTERNAL
                assert "non-finite logits" in str(out.error)
                assert sum(calls.values()) == 1
            else:
                assert out.error is None and len(out.token_ids) == 4
                assert sum(calls.values()) == 2
        finally:
            await stop_all(router, workers)

    asyncio.run(scenario())


@pytest.mark.slow  # a worker process: ~15 s on a 2-core CPU
def test_worker_refuses_bad_token_ids_as_deterministic_and_keeps_nothing(
        demo_dir: Path, tmp_path: Path) -> None:
    worker, address, metrics, _ = start_worker(demo_dir, tmp_path)
    try:
        vocab = json.loads((demo_dir / "model" / "config.json").read_text())["vocab_size"]
        with grpc.insecure_channel(address) as channel:
            stub = pb_grpc.InferenceServiceStub(channel)
            for ids in ([-1], [3, vocab], [2**31 - 1]):
                with pytest.raises(grpc.RpcError) as info:
                    list(stub.Generate(ids_request(ids), timeout=30))
                err = info.value
                assert err.code() == grpc.StatusCode.INVALID_ARGUMENT, err.details()
                assert "out of range" in (err.details() or "")
                assert (e.DETERMINISTIC, "1") in tuple(err.trailing_metadata() or ())
            # The worker still serves, and its engine holds nothing for the refused requests.
            ok = list(stub.Generate(ids_request([1, 2, vocab - 1]), timeout=30))
            assert ok[-1].complete.usage.completion_tokens == 4
        idle, m = scrape_when_idle(metrics, 5)
        assert idle, m
    finally:
        worker.kill()
