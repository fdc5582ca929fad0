"""quiet_grpc_poller_wakeups: grpc.aio's spurious poller wakeup (BlockingIOError raised in
PollerCompletionQueue._handle_events) is logged at DEBUG; every other loop exception still
reaches the handler that was installed before (asyncio's default when none)."""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import pytest

from services.common.server import quiet_grpc_poller_wakeups


class PollerCompletionQueue:
    """Named like grpc's class so the handle's repr reads as it does in a real report."""

    def _handle_events(self) -> None:
        raise BlockingIOError(11, "Resource temporarily unavailable")


def report(loop: asyncio.AbstractEventLoop, exc: BaseException, callback: Any) -> None:
    """What asyncio passes to the handler when a callback raises (events.Handle._run)."""
    handle = asyncio.Handle(callback, (), loop)
    loop.call_exception_handler({"message": f"Exception in callback {handle!r}",
                                 "exception": exc, "handle": handle})


def test_the_poller_wakeup_is_dropped_and_the_rest_reach_the_handler_before() -> None:
    seen: list[str] = []

    async def scenario() -> None:
        loop = asyncio.get_running_loop()
        loop.set_exception_handler(lambda _loop, ctx: seen.append(str(ctx["message"])))
        quiet_grpc_poller_wakeups()
        quiet_grpc_poller_wakeups()  # twice: still one filter in front of the handler
        poller = PollerCompletionQueue()
        report(loop, BlockingIOError(11, "EAGAIN"), poller._handle_events)
        report(loop, ValueError("ours"), poller._handle_events)  # not a wakeup: passed on
        report(loop, BlockingIOError(11, "EAGAIN"), print)  # someone else's EAGAIN: passed on
        # A callback that really raises, run by the loop itself.
        loop.call_soon(poller._handle_events)
        await asyncio.sleep(0)
        await asyncio.sleep(0)

    asyncio.run(scenario())
    assert len(seen) == 2, seen
    assert all("PollerCompletionQueue._handle_events" in s or "print" in s for s in seen)


def test_without_a_handler_before_the_rest_go_to_asyncios_default(
        caplog: pytest.LogCaptureFixture) -> None:
    async def scenario() -> None:
        quiet_grpc_poller_wakeups()
        loop = asyncio.get_running_loop()
        loop.call_soon(PollerCompletionQueue()._handle_events)
        report(loop, RuntimeError("boom"), print)
        await asyncio.sleep(0)

    with caplog.at_level(logging.DEBUG):
        asyncio.run(scenario())
    errors = [r for r in caplog.records if r.levelno >= logging.ERROR]
    assert [r.name for r in errors] == ["asyncio"], errors
    assert "print" in errors[0].getMessage()
    assert any("grpc poller woke" in r.getMessage() for r in caplog.records
               if r.levelno == logging.DEBUG)
