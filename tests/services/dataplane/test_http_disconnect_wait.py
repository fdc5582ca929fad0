"""The HTTP handler's wait for a first message (or a whole answer) runs in the handler's own
task, and a client that leaves meanwhile cancels it (`HttpApi._unless_disconnected`): the work
is cancelled, the calls closed and the disconnect counted, and the handler's task carries no
cancel afterwards, also when the client leaves in the same loop turn as the work ends."""

from __future__ import annotations

import asyncio
import contextlib
from typing import Any

from services.gateway.http_api import HttpApi
from services.gateway.metrics import GatewayMetrics


class FakeRequest:
    """`receive()` answers http.disconnect once `leave` is set (at once if set already)."""

    def __init__(self) -> None:
        self.leave = asyncio.Event()

    async def receive(self) -> dict[str, Any]:
        await self.leave.wait()
        return {"type": "http.disconnect"}


class FakeFanout:
    def __init__(self) -> None:
        self.closed = 0

    async def close(self) -> None:
        self.closed += 1


def api() -> HttpApi:
    return HttpApi(router=None, metrics=GatewayMetrics(), base_model="m")  # type: ignore[arg-type]


def disconnects(a: HttpApi) -> float:
    return a.metrics.http_disconnects._value.get()


async def still_uncancelled() -> None:
    """The handler's task has no cancel pending: later awaits run (one stray cancel raises)."""
    task = asyncio.current_task()
    assert task is not None and task.cancelling() == 0
    for _ in range(3):
        await asyncio.sleep(0)


def test_work_that_ends_first_is_answered() -> None:
    async def scenario() -> None:
        a, request, fanout = api(), FakeRequest(), FakeFanout()
        ran_in = []

        async def work() -> None:
            ran_in.append(asyncio.current_task())
            await asyncio.sleep(0.01)

        assert await a._unless_disconnected(request, fanout, work())  # type: ignore[arg-type]
        assert ran_in == [asyncio.current_task()]  # no task of its own
        assert fanout.closed == 0 and disconnects(a) == 0
        request.leave.set()  # the watcher is gone: a later disconnect cancels nothing here
        await still_uncancelled()

    asyncio.run(scenario())


def test_a_client_that_leaves_cancels_the_work_and_closes_the_calls() -> None:
    async def scenario() -> None:
        a, request, fanout = api(), FakeRequest(), FakeFanout()
        cancelled = asyncio.Event()

        async def work() -> None:
            try:
                await asyncio.sleep(30)
            except asyncio.CancelledError:
                cancelled.set()
                raise

        asyncio.get_running_loop().call_later(0.01, request.leave.set)
        assert not await a._unless_disconnected(request, fanout, work())  # type: ignore[arg-type]
        assert cancelled.is_set() and fanout.closed == 1 and disconnects(a) == 1
        await still_uncancelled()

    asyncio.run(scenario())


def test_work_that_swallows_the_cancel_still_counts_as_a_disconnect() -> None:
    async def scenario() -> None:
        a, request, fanout = api(), FakeRequest(), FakeFanout()

        async def work() -> None:
            # ends quietly, as a call that catches its cancel would
            with contextlib.suppress(asyncio.CancelledError):
                await asyncio.sleep(30)

        asyncio.get_running_loop().call_later(0.01, request.leave.set)
        assert not await a._unless_disconnected(request, fanout, work())  # type: ignore[arg-type]
        assert fanout.closed == 1 and disconnects(a) == 1
        await still_uncancelled()

    asyncio.run(scenario())


def test_a_client_that_leaves_as_the_work_ends_leaves_no_cancel_behind() -> None:
    async def scenario() -> None:
        a, request, fanout = api(), FakeRequest(), FakeFanout()
        request.leave.set()  # the watcher ends on its first turn; its callback runs a turn later

        async def work() -> None:
            await asyncio.sleep(0)  # resumes in the watcher's turn, after it: ends first

        assert await a._unless_disconnected(request, fanout, work())  # type: ignore[arg-type]
        assert fanout.closed == 0 and disconnects(a) == 0
        await still_uncancelled()  # the watcher's callback came after the end: it did nothing

    asyncio.run(scenario())
