"""bench.gateway_hop's fake worker: the closed loop's hand-over lag it records (the time from
the step that gave a stream its last token to the arrival of the next request)."""

from __future__ import annotations

import asyncio
import contextlib

import pytest

from bench import gateway_hop
from bench.gateway_hop import FakeWorker
from slora.v1 import inference_pb2 as pb


def test_a_successor_is_timed_from_its_predecessors_last_step() -> None:
    async def scenario() -> list[list[float]]:
        worker = FakeWorker(0.005)
        ticking = asyncio.create_task(worker.step_loop())
        request = pb.GenerateRequest(sampling=pb.SamplingOptions(max_new_tokens=3))
        taken = []
        try:
            first = [r async for r in worker.serve(request, "", None)]
            assert [len(r.chunk.token_ids) for r in first[:-1]] == [1, 1, 1]
            assert first[-1].complete.usage.completion_tokens == 3
            await asyncio.sleep(0.03)
            second = worker.serve(request, "", None)
            await anext(second)  # arrived: paired with the first one's last step
            taken.append(worker.take_lags())
            taken.append(worker.take_lags())  # taken once
            await second.aclose()
            third = worker.serve(request, "", None)
            await anext(third)  # the second never ended: no step to pair it with
            taken.append(worker.take_lags())
            await third.aclose()
        finally:
            ticking.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await ticking
        return taken

    (lag,), again, unpaired = asyncio.run(scenario())
    assert 0.03 <= lag < 0.2
    assert again == [] and unpaired == []


@pytest.mark.parametrize("spread", ["-1", "64", "80"])
def test_a_spread_outside_the_lengths_is_a_usage_error(spread: str) -> None:
    with pytest.raises(SystemExit) as e:
        gateway_hop.parse_args(["--new-tokens", "64", "--new-tokens-spread", spread])
    assert e.value.code == 2
    assert gateway_hop.parse_args(["--new-tokens", "64", "--new-tokens-spread", "63"]) \
        .new_tokens_spread == 63
