"""The gateway's side of its worker calls: one long-lived channel per worker, and a reader that
keeps each call drained so a slow client gets the chunks already waiting as one message.

A gRPC call only receives a message when it is read, so without a reader of its own a stream
whose client falls behind leaves every token as its own message, and the client pays one write
per token on top of its delay. The reader here pulls each message as soon as the worker sends it;
the consumer takes everything waiting at once and merges the chunks.
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import AsyncGenerator

import grpc

from services.common.hop_auth import GatewayTokenInterceptor
from services.common.server import CHANNEL_OPTIONS
from services.common.tls import open_channel
from slora.v1 import inference_pb2 as pb
from slora.v1 import inference_pb2_grpc as pb_grpc

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

    def __init__(self, call: grpc.aio.UnaryStreamCall) -> None:
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
