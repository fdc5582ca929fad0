"""The calls of one HTTP request (services/gateway/fanout.py): `start()` waits for every call's
first message and fails the request, closing every call, when one cannot start; one call is
started in the caller's own task (no task of its own to wait a loop turn), several together."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import pytest

from services.common import errors as e
from services.gateway.fanout import Fanout
from slora.v1 import inference_pb2 as pb


def chunk(text: str) -> pb.GenerateResponse:
    return pb.GenerateResponse(chunk=pb.Chunk(token_ids=[1], text=text))


class FakeCall:
    """An async iterable as a RoutedCall is: `texts` as chunks, or `error` before the first."""

    def __init__(self, texts: list[str], error: Exception | None = None) -> None:
        self.texts, self.error = texts, error
        self.closed = False
        self.tasks: list[asyncio.Task[object] | None] = []

    def __aiter__(self) -> AsyncIterator[pb.GenerateResponse]:
        return self._run()

    async def _run(self) -> AsyncIterator[pb.GenerateResponse]:
        try:
            self.tasks.append(asyncio.current_task())
            if self.error is not None:
                raise self.error
            for text in self.texts:
                yield chunk(text)
                await asyncio.sleep(0)
        finally:
            self.closed = True


async def collect(fanout: Fanout) -> list[tuple[int, str]]:
    return [(i, r.chunk.text) async for i, r in fanout.events()]


def test_one_call_starts_in_the_callers_task_and_streams_on() -> None:
    async def scenario() -> None:
        call = FakeCall(["a", "b", "c"])
        fanout = Fanout([call])  # type: ignore[list-item]
        await fanout.start()
        assert call.tasks == [asyncio.current_task()]
        assert await collect(fanout) == [(0, "a"), (0, "b"), (0, "c")]

    asyncio.run(scenario())


@pytest.mark.parametrize("calls", [1, 2])
def test_a_call_that_cannot_start_fails_the_request_and_closes_every_call(calls: int) -> None:
    async def scenario() -> None:
        bad = FakeCall([], e.NotFound("unknown adapter 'x'"))
        others = [FakeCall(["a", "b"]) for _ in range(calls - 1)]
        fanout = Fanout([*others, bad])  # type: ignore[list-item]
        with pytest.raises(e.NotFound, match="unknown adapter"):
            await fanout.start()
        assert bad.closed and all(o.closed for o in others)

    asyncio.run(scenario())


@pytest.mark.parametrize("calls", [1, 2])
def test_a_call_that_ends_without_a_message_is_an_internal_error(calls: int) -> None:
    async def scenario() -> None:
        fanout = Fanout([*(FakeCall(["a"]) for _ in range(calls - 1)),  # type: ignore[list-item]
                         FakeCall([])])
        with pytest.raises(e.Internal, match="without a message"):
            await fanout.start()

    asyncio.run(scenario())


def test_several_calls_interleave_by_choice() -> None:
    async def scenario() -> None:
        fanout = Fanout([FakeCall(["a", "b"]), FakeCall(["x", "y"])])  # type: ignore[list-item]
        await fanout.start()
        got = await collect(fanout)
        assert sorted(got) == [(0, "a"), (0, "b"), (1, "x"), (1, "y")]
        assert got[:2] == [(0, "a"), (1, "x")]  # the first messages, in choice order
        await fanout.close()

    asyncio.run(scenario())
