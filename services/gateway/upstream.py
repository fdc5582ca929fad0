"""The gateway's side of its worker calls: one long-lived channel per worker, and a reader that
keeps each call drained so a slow client gets the chunks already waiting as one message.

A gRPC call only receives a message when it is read, so without a reader of its own a stream
whose client falls behind leaves every token as its own message, and the client pays one write
per token on top of its delay. The reader here pulls each message as soon as the worker sends it;
the consumer takes everything waiting at once and merges the chunks.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from collections.abc import AsyncGenerator, Callable

import grpc

from services.common.hop_auth import GatewayTokenInterceptor
from services.common.server import CHANNEL_OPTIONS
from services.common.tls import open_channel
from slora.v1 import inference_pb2 as pb
from slora.v1 import inference_pb2_grpc as pb_grpc

log = logging.getLogger(__name__)

# A worker that answers GenerateOpen UNIMPLEMENTED (older than it) is called per request for
# this long before its idle calls are tried again.
WARM_RETRY_S = 60.0

# One HTTP/2 connection per worker carries every stream the gateway sends it. The worker's
# server takes gRPC core's default concurrent-stream limit (unbounded), so streams never queue
# behind this channel; the receive limit is raised because a coalesced message can carry many
# chunks.
WORKER_CHANNEL_OPTIONS: tuple[tuple[str, int], ...] = (
    *CHANNEL_OPTIONS,
    ("grpc.max_receive_message_length", 64 * 1024 * 1024),
)


class WorkerChannels:
    """address -> its one channel, opened at first use and kept for the process's life."""

    def __init__(self) -> None:
        self._channels: dict[str, grpc.aio.Channel] = {}
        # Workers serve gateways only: every call carries $SLORA_GATEWAY_TOKEN (hop_auth.py).
        self._interceptors = GatewayTokenInterceptor.from_env()

    def stub(self, address: str) -> pb_grpc.InferenceServiceStub:
        channel = self._channels.get(address)
        if channel is None:
            channel = open_channel(address, options=WORKER_CHANNEL_OPTIONS,
                                   interceptors=self._interceptors)  # TLS when configured
            self._channels[address] = channel
        return pb_grpc.InferenceServiceStub(channel)

    async def close(self) -> None:
        """At shutdown. (A worker that leaves keeps its idle channel: closing it while a
        draining worker still streams would cut those streams.)"""
        for channel in self._channels.values():
            await channel.close()
        self._channels.clear()


def merge_chunks(responses: list[pb.GenerateResponse]) -> list[pb.GenerateResponse]:
    """Consecutive `chunk` messages merged into one (token ids, text and logprobs in order);
    a `complete` stays its own message, after the chunks before it."""
    out: list[pb.GenerateResponse] = []
    run: list[pb.Chunk] = []
    for r in responses:
        if r.HasField("chunk"):
            run.append(r.chunk)
            continue
        if run:
            out.append(_merged(run))
            run = []
        out.append(r)
    if run:
        out.append(_merged(run))
    return out


def _merged(chunks: list[pb.Chunk]) -> pb.GenerateResponse:
    if len(chunks) == 1:
        return pb.GenerateResponse(chunk=chunks[0])
    merged = pb.Chunk(text="".join(c.text for c in chunks))
    for c in chunks:
        merged.token_ids.extend(c.token_ids)
        merged.logprobs.extend(c.logprobs)
    return pb.GenerateResponse(chunk=merged)


def rpc_error(code: grpc.StatusCode, details: str,
              trailing: tuple[tuple[str, str], ...] = ()) -> grpc.aio.AioRpcError:
    """The error a per-call Generate ending with this status would have raised."""
    return grpc.aio.AioRpcError(code, grpc.aio.Metadata(), grpc.aio.Metadata(*trailing),
                                details)


class Buffered:
    """One upstream stream's responses, held as they arrive until its one consumer takes
    them: `batches()` yields, each time, the messages that arrived since the previous batch,
    chunks merged, and raises the stream's error at its end. Closing the consumer early
    (a client cancel or deadline) calls `cancel()`, which must free the worker's request."""

    def __init__(self) -> None:
        self._waiting: deque[pb.GenerateResponse] = deque()
        self._arrived = asyncio.Event()
        self._error: BaseException | None = None
        self._ended = False

    def put(self, response: pb.GenerateResponse) -> None:
        self._waiting.append(response)
        self._arrived.set()

    def end(self, error: BaseException | None) -> None:
        if not self._ended:
            self._ended, self._error = True, error
            self._arrived.set()

    async def batches(self) -> AsyncGenerator[list[pb.GenerateResponse], None]:
        try:
            while True:
                await self._arrived.wait()
                self._arrived.clear()
                if self._waiting:
                    taken = list(self._waiting)
                    self._waiting.clear()
                    yield merge_chunks(taken) if len(taken) > 1 else taken
                if self._ended and not self._waiting:
                    if self._error is not None:
                        raise self._error
                    return
        finally:
            self.cancel()

    def cancel(self) -> None:
        raise NotImplementedError


class DrainedCall(Buffered):
    """A per-call Generate read ahead of its consumer; `cancel()` cancels the worker call, so
    the worker frees the request's pages."""

    def __init__(self, call: grpc.aio.UnaryStreamCall | grpc.aio.StreamStreamCall) -> None:
        super().__init__()
        self._call = call
        self._reader = asyncio.create_task(self._read())

    async def _read(self) -> None:
        try:
            async for r in self._call:
                self.put(r)
        except BaseException as exc:  # noqa: BLE001 - handed to the consumer, raised there
            self.end(exc)
        else:
            self.end(None)

    def cancel(self) -> None:
        self._call.cancel()
        self._reader.cancel()


class WarmCalls:
    """Idle `GenerateOpen` calls kept open to each worker, `size` an address, so a request
    costs one message on a call already open instead of a new call (a new call's own cost
    was about 0.6 ms on the way in on a 2-core machine, docs/performance.md); its tokens come
    back on that call alone, as a per-call Generate's do. A call taken is replaced once its
    request has its first answer (`refill`), so opening the next call (a new call's cost, on
    both ends) falls in the wait for the engine's step, not on a request's way in; the first
    request to an address finds none and goes per call."""

    def __init__(self, channels: WorkerChannels, size: int) -> None:
        if size < 1:
            raise ValueError(f"a pool of idle calls needs a size of at least 1, got {size}")
        self.channels = channels
        self.size = size
        self._idle: dict[str, deque[grpc.aio.StreamStreamCall]] = {}
        self._off_until: dict[str, float] = {}  # address -> when to try its idle calls again

    def take(self, address: str) -> grpc.aio.StreamStreamCall | None:
        """An open idle call to `address`, or None (none open, or the worker has no
        GenerateOpen: then the pool is topped up at once)."""
        until = self._off_until.get(address)
        if until is not None:
            if time.monotonic() < until:
                return None
            del self._off_until[address]
        idle = self._idle.setdefault(address, deque())
        while idle:
            call = idle.popleft()
            if not call.done():  # a worker that drained or restarted ended it
                return call
        self.refill(address)
        return None

    def refill(self, address: str) -> None:
        """Open calls to `address` until `size` are idle."""
        if address in self._off_until:
            return
        idle = self._idle.setdefault(address, deque())
        while len(idle) < self.size:
            idle.append(self.channels.stub(address).GenerateOpen())

    def unsupported(self, address: str) -> None:
        """The worker answered GenerateOpen UNIMPLEMENTED: per call for WARM_RETRY_S."""
        log.warning("worker %s does not serve GenerateOpen: calling it per request", address)
        self._off_until[address] = time.monotonic() + WARM_RETRY_S
        for call in self._idle.pop(address, ()):
            call.cancel()

    def close(self) -> None:
        for idle in self._idle.values():
            for call in idle:
                call.cancel()
        self._idle.clear()


class OpenedCall(DrainedCall):
    """A request sent on an idle `GenerateOpen` call and read ahead like a DrainedCall. When
    the call turns out finished before the request went, or the worker has no GenerateOpen,
    the request goes as a per-call Generate (`per_call`) instead: nothing reached the worker."""

    def __init__(self, call: grpc.aio.StreamStreamCall, first: pb.MuxRequest,
                 per_call: Callable[[], grpc.aio.UnaryStreamCall],
                 on_unsupported: Callable[[], None], on_answered: Callable[[], None]) -> None:
        self._first = first
        self._per_call = per_call
        self._on_unsupported = on_unsupported
        # Called once: at the first answer, or the end (WarmCalls.refill).
        self._on_answered: Callable[[], None] | None = on_answered
        super().__init__(call)
        # The caller's deadline, kept here as a per-call deadline is kept by gRPC (the idle
        # call was opened without one; the worker keeps it too, from `first`).
        self._timer = (asyncio.get_running_loop().call_later(max(first.timeout_s, 0.0),
                                                             self._expire)
                       if first.HasField("timeout_s") else None)

    def put(self, response: pb.GenerateResponse) -> None:
        super().put(response)
        self._answered()

    def end(self, error: BaseException | None) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        super().end(error)
        self._answered()

    def _expire(self) -> None:
        self._timer = None
        if not self._ended:
            self.end(rpc_error(grpc.StatusCode.DEADLINE_EXCEEDED, "Deadline Exceeded"))
            self.cancel()

    def _answered(self) -> None:
        answered, self._on_answered = self._on_answered, None
        if answered is not None:
            answered()

    async def _read(self) -> None:
        warm = self._call
        assert isinstance(warm, grpc.aio.StreamStreamCall)
        got = False
        try:
            await warm.write(self._first)
            await warm.done_writing()
            async for r in warm:
                got = True
                self.put(r)
        except asyncio.InvalidStateError:  # it finished before the write: nothing went
            unsupported = await warm.code() == grpc.StatusCode.UNIMPLEMENTED
        except grpc.aio.AioRpcError as exc:
            if got or exc.code() != grpc.StatusCode.UNIMPLEMENTED:
                self.end(exc)
                return
            unsupported = True  # refused before the worker took the request
        except BaseException as exc:  # noqa: BLE001 - handed to the consumer, raised there
            self.end(exc)
            return
        else:
            self.end(None)
            return
        if unsupported:
            self._on_unsupported()
        self._call = self._per_call()
        await super()._read()
