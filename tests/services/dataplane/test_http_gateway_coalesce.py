"""The gateway's read-ahead of a worker call: a consumer that falls behind gets the chunks
already waiting as one message (tokens, text and logprobs in order, `complete` kept apart); one
that keeps up gets every message as it came; closing the consumer cancels the worker call."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import pytest

from services.gateway.upstream import DrainedCall, merge_chunks
from slora.v1 import inference_pb2 as pb


def chunk(token: int) -> pb.GenerateResponse:
    return pb.GenerateResponse(chunk=pb.Chunk(
        token_ids=[token], text=f"<{token}>",
        logprobs=[pb.TokenLogprob(token_id=token, logprob=-token / 10)]))


def complete() -> pb.GenerateResponse:
    return pb.GenerateResponse(complete=pb.Complete(finish_reason="length"))


class FakeCall:
    """A worker call: yields `items` (an exception is raised), one per `gap_s`."""

    def __init__(self, items: list[pb.GenerateResponse | Exception], gap_s: float = 0.0):
        self.items, self.gap_s, self.cancelled = items, gap_s, False

    async def __aiter__(self) -> AsyncIterator[pb.GenerateResponse]:
        for item in self.items:
            await asyncio.sleep(self.gap_s)
            if isinstance(item, Exception):
                raise item
            yield item

    def cancel(self) -> bool:
        self.cancelled = True
        return True


def test_merge_keeps_order_and_the_complete_apart() -> None:
    merged = merge_chunks([chunk(1), chunk(2), chunk(3), complete()])
    assert len(merged) == 2 and merged[1].HasField("complete")
    c = merged[0].chunk
    assert list(c.token_ids) == [1, 2, 3] and c.text == "<1><2><3>"
    assert [lp.token_id for lp in c.logprobs] == [1, 2, 3]


async def consume(call: FakeCall, delay_s: float) -> list[list[pb.GenerateResponse]]:
    batches = []
    async for batch in DrainedCall(call).batches():  # type: ignore[arg-type]
        batches.append(batch)
        await asyncio.sleep(delay_s)
    return batches


def test_a_slow_consumer_gets_what_is_waiting_as_one_message() -> None:
    call = FakeCall([chunk(i) for i in range(1, 11)] + [complete()])
    batches = asyncio.run(consume(call, delay_s=0.05))
    # everything arrives while the consumer sleeps on the first batch
    assert len(batches) == 2
    assert [len(b) for b in batches] == [1, 2]
    assert list(batches[1][0].chunk.token_ids) == list(range(2, 11))
    assert batches[1][1].HasField("complete")


def test_a_consumer_that_keeps_up_gets_each_message() -> None:
    call = FakeCall([chunk(i) for i in range(1, 5)] + [complete()], gap_s=0.01)
    batches = asyncio.run(consume(call, delay_s=0.0))
    assert [len(b) for b in batches] == [1] * 5


def test_an_error_after_the_chunks_is_raised_after_them() -> None:
    call = FakeCall([chunk(1), chunk(2), RuntimeError("worker died")])
    got: list[pb.GenerateResponse] = []

    async def run() -> None:
        async for batch in DrainedCall(call).batches():  # type: ignore[arg-type]
            got.extend(batch)
            await asyncio.sleep(0.02)

    with pytest.raises(RuntimeError, match="worker died"):
        asyncio.run(run())
    assert [t for r in got for t in r.chunk.token_ids] == [1, 2]


def test_closing_the_consumer_cancels_the_worker_call() -> None:
    call = FakeCall([chunk(i) for i in range(100)], gap_s=0.01)

    async def run() -> None:
        batches = DrainedCall(call).batches()  # type: ignore[arg-type]
        await anext(batches)
        await batches.aclose()  # type: ignore[attr-defined]

    asyncio.run(run())
    assert call.cancelled
