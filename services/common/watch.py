"""The subscriber side of a watch stream: reconnect with backoff, send from a queue."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Awaitable, Callable, Coroutine
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

    async def __aiter__(self) -> AsyncIterator[Any]:
        while True:
            yield await self._queue.get()


async def watch_forever(
    target: str,
    open_stream: Callable[[grpc.aio.Channel, Outbox], grpc.aio.StreamStreamCall],
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
    while True:
        outbox = Outbox(hello())
        keepalive: asyncio.Task[None] | None = None
        try:
            # Keepalive pings (servers built with SERVER_OPTIONS accept them): a control plane
            # whose host died, not just its process, is noticed in seconds, not TCP's minutes.
            async with open_channel(target, options=CHANNEL_OPTIONS) as channel:  # TLS if set
                call = open_stream(channel, outbox)
                if on_connected is not None:
                    keepalive = asyncio.create_task(on_connected(outbox))
                async for msg in call:
                    backoff = INITIAL_BACKOFF_S
                    await on_update(msg, outbox)
        except grpc.aio.AioRpcError as exc:
            # A refused credential will not fix itself: say so louder than a dropped connection.
            level = (logging.WARNING if exc.code() == grpc.StatusCode.UNAUTHENTICATED
                     else logging.INFO)
            log.log(level, "watch %s: %s %s; reconnecting", target, exc.code().name,
                    exc.details())
        finally:
            if keepalive is not None:
                keepalive.cancel()
            if on_disconnected is not None:
                on_disconnected()
        await asyncio.sleep(backoff)
        backoff = min(backoff * 2, max_backoff_s)
