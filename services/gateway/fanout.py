"""The calls of one HTTP request (prompts x n), started together and read as one stream."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

from services.common import errors as e
from services.gateway.router import RoutedCall
from slora.v1 import inference_pb2 as pb

Event = tuple[int, pb.GenerateResponse]  # (choice index, message)
_END = None


class Fanout:
    """`start()` waits for every call's first message, so a call that cannot be routed or
    served fails the whole request before any byte of a response is sent; `events()` then
    yields every call's messages as they come; `close()` cancels what is still running (the
    worker calls with it)."""

    def __init__(self, calls: list[RoutedCall]) -> None:
        self.calls = calls
        self._iters = [aiter(c) for c in calls]
        self._first: list[pb.GenerateResponse] = []
        self._pumps: list[asyncio.Task[None]] = []

    async def start(self) -> None:
        got: list[pb.GenerateResponse | BaseException]
        if len(self._iters) == 1:  # in this task: gather's task would wait a loop turn
            try:
                got = [await anext(self._iters[0])]
            except Exception as exc:  # noqa: BLE001 - raised below, as gather's would be
                got = [exc]
        else:
            got = list(await asyncio.gather(*(anext(it) for it in self._iters),
                                            return_exceptions=True))
        failed = [g for g in got if isinstance(g, BaseException)]
        if failed:
            await self.close()
            first = failed[0]
            if isinstance(first, StopAsyncIteration):
                raise e.Internal("a worker ended a call without a message")
            raise first
        self._first = [g for g in got if isinstance(g, pb.GenerateResponse)]

    async def events(self) -> AsyncIterator[Event]:
        for i, r in enumerate(self._first):
            yield i, r
        if len(self._iters) == 1:
            async for r in self._iters[0]:
                yield 0, r
            return
        queue: asyncio.Queue[tuple[int, pb.GenerateResponse | BaseException | None]] = (
            asyncio.Queue())
        self._pumps = [asyncio.create_task(_pump(i, it, queue))
                       for i, it in enumerate(self._iters)]
        running = len(self._pumps)
        while running:
            i, item = await queue.get()
            if item is _END:
                running -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield i, item

    async def close(self) -> None:
        """Cancel every call still running; safe to call more than once."""
        for task in self._pumps:
            task.cancel()
        for it in self._iters:
            # A generator a pump still drives closes when the pump's cancel reaches it.
            with contextlib.suppress(RuntimeError, asyncio.CancelledError):
                await it.aclose()  # type: ignore[attr-defined]


async def _pump(index: int, it: AsyncIterator[pb.GenerateResponse],
                queue: asyncio.Queue[tuple[int, pb.GenerateResponse | BaseException | None]],
                ) -> None:
    try:
        async for r in it:
            queue.put_nowait((index, r))
        queue.put_nowait((index, _END))
    except Exception as exc:  # noqa: BLE001 - the consumer raises it
        queue.put_nowait((index, exc))
