"""The subscriber side of a watch stream: reconnect with backoff, send from a queue."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable, Coroutine
from typing import Any, TypeVar

import grpc

from services.common.server import CHANNEL_OPTIONS
from services.common.tls import open_channel

log = logging.getLogger(__name__)
M = TypeVar("M")
INITIAL_BACKOFF_S = 0.1
# Kept short: while the control plane restarts, a subscriber that backed off longer would
# see its routes (gateway) or placements (worker) that much later once it is back. An attempt
# on a closed port costs a connection refusal.
MAX_BACKOFF_S = 0.5


class Outbox:
    """Messages to send on the current stream; a new stream starts with a fresh outbox."""

    def __init__(self, first: Any) -> None:
        self._queue: asyncio.Queue[Any] = asyncio.Queue()
        self._queue.put_nowait(first)

    def put(self, msg: Any) -> None:
        self._queue.put_nowait(msg)

    async def get(self) -> Any:
        return await self._queue.get()


async def _write_all(call: grpc.aio.StreamStreamCall, outbox: Outbox) -> None:
    """Send the outbox's messages on `call` until the call ends or this task is cancelled.

    Our own task writing with `call.write`, not a request iterator handed to grpc: grpc
    consumes an iterator in a task of its own that it abandons when the call breaks, and on
    every control-plane restart that logged "Task was destroyed but it is pending!" and
    "aclose(): asynchronous generator is already running" at ERROR."""
    while True:
        msg = await outbox.get()
        try:
            await call.write(msg)
        except (grpc.aio.AioRpcError, grpc.aio.UsageError, asyncio.InvalidStateError):
            return  # the call ended; its reader reports why


async def watch_forever(
    target: str,
    open_stream: Callable[[grpc.aio.Channel], grpc.aio.StreamStreamCall],
    hello: Callable[[], Any],
    on_update: Callable[[Any, Outbox], Awaitable[None]],
    on_connected: Callable[[Outbox], Coroutine[Any, Any, None]] | None = None,
    on_disconnected: Callable[[], None] | None = None,
    max_backoff_s: float = MAX_BACKOFF_S,
) -> None:
    """Keep a watch stream to `target` open until cancelled.

    Each connection sends `hello()` first, then whatever the callbacks put in the outbox;
    every received message goes to `on_update`. A broken stream is reopened after a backoff
    that doubles up to `max_backoff_s` and resets once a message arrived."""
    backoff = INITIAL_BACKOFF_S
    failures = 0  # in a row: the first is logged at INFO, the rest (retries) at DEBUG
    while True:
        outbox = Outbox(hello())
        tasks: list[asyncio.Task[None]] = []
        try:
            # Keepalive pings (servers built with SERVER_OPTIONS accept them): a control plane
            # whose host died, not just its process, is noticed in seconds, not TCP's minutes.
            async with open_channel(target, options=CHANNEL_OPTIONS) as channel:  # TLS if set
                call = open_stream(channel)
                tasks.append(asyncio.create_task(_write_all(call, outbox)))
                if on_connected is not None:
                    tasks.append(asyncio.create_task(on_connected(outbox)))
                try:
                    async for msg in call:
                        backoff, failures = INITIAL_BACKOFF_S, 0
                        await on_update(msg, outbox)
                finally:
                    await _stop(tasks)
                    call.cancel()
        except grpc.aio.AioRpcError as exc:
            failures += 1
            # A refused credential will not fix itself: say so louder than a dropped connection.
            level = (logging.WARNING if exc.code() == grpc.StatusCode.UNAUTHENTICATED
                     else logging.INFO if failures == 1 else logging.DEBUG)
            log.log(level, "watch %s: %s %s; reconnecting", target, exc.code().name,
                    exc.details())
        finally:
            if on_disconnected is not None:
                on_disconnected()
        await asyncio.sleep(backoff)
        backoff = min(backoff * 2, max_backoff_s)


async def _stop(tasks: list[asyncio.Task[None]]) -> None:
    """Cancel `tasks` and wait for them, so none is left pending when the stream is gone."""
    for t in tasks:
        t.cancel()
    for t in tasks:
        with contextlib.suppress(asyncio.CancelledError, Exception):
            await t
