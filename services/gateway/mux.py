"""The gateway's worker calls over `GenerateMux`: one long-lived stream from this gateway
process to each worker carries every request it sends that worker (docs/DESIGN.md, "the
gateway -> worker hop").

A request then costs no new call (about 1.3 ms of a first token's time on the H200), and the
worker sends an engine step's tokens for all its streams as one message. Each request is a
`MuxedCall`, a `Buffered` like the per-call `DrainedCall`: the mux's reader puts every
response into its stream's own buffer and never waits for a consumer, so one slow client
holds up no other stream. A stream's error arrives as the `grpc.aio.AioRpcError` the
per-call path would raise (same code, message and trailing metadata), so the router's
retry, resume and fallback rules apply unchanged. When the mux breaks, each of its streams
fails UNAVAILABLE (retryable, resumable), and the next request opens a new mux.

Alone (`slora gateway --upstream mux`) it saves the gateway CPU, and wins where the gateway is
short of it, but on an H100 host it did not beat one call a request at light load
(docs/performance.md, "Tried: one long-lived multiplexed stream"). The default, `--upstream
auto`, takes the mux only past `--mux-from` streams in flight on a worker (`Upstreams`): on an
H100 host at 256 streams it cut the gRPC TTFT added from 195 to 35 ms p50 (docs/performance.md,
"The gateway's upstream: auto by default").
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import time
from collections.abc import AsyncGenerator, Callable

import grpc

from services.common import hop_trace
from services.common.hop_auth import TENANT_HEADER
from services.gateway.upstream import Buffered, DrainedCall, WorkerChannels
from slora.v1 import inference_pb2 as pb

log = logging.getLogger(__name__)
# A worker that does not serve GenerateMux (an older version) is called per request; the mux
# is tried again after this long (the worker may have been upgraded).
PER_CALL_RETRY_S = 60.0
# A mux with no stream for this long is closed (the worker's session with it ends); the next
# request to that worker opens a new one.
MUX_IDLE_CLOSE_S = 300.0
CODES = {code.value[0]: code for code in grpc.StatusCode}  # MuxEnd.code -> its StatusCode
# An up-frame stays under the worker's receive limit (gRPC's 4 MiB default): a frame over it
# would end the mux and fail every stream on it. The writer splits what it gathered into
# frames of at most this many bytes; a request bigger than this alone goes per call, where the
# worker refuses it (or serves it) as it would any Generate, and no other stream notices.
MAX_UP_FRAME_BYTES = 1024 * 1024


def rpc_error(code: grpc.StatusCode, details: str,
              trailing: tuple[tuple[str, str], ...] = ()) -> grpc.aio.AioRpcError:
    """The error a per-call Generate ending with this status would have raised."""
    return grpc.aio.AioRpcError(code, grpc.aio.Metadata(), grpc.aio.Metadata(*trailing),
                                details)


class MuxUnsupported(Exception):
    """The worker does not serve GenerateMux, or may not: its streams go per call instead."""


class MuxedCall(Buffered):
    """One request on a mux. `per_call` makes the same request as a per-call Generate, for
    a worker that turned out not to serve the mux."""

    def __init__(self, mux: WorkerMux, stream_id: int, timeout_s: float | None,
                 per_call: Callable[[], Buffered]) -> None:
        super().__init__()
        self.mux = mux
        self.stream_id = stream_id
        self._per_call = per_call
        # The caller's deadline, kept here as a per-call deadline is kept by gRPC.
        self._timer = None if timeout_s is None else asyncio.get_running_loop().call_later(
            max(timeout_s, 0.0), self._expire)

    async def batches(self) -> AsyncGenerator[list[pb.GenerateResponse], None]:
        try:
            async with contextlib.aclosing(super().batches()) as own:
                async for batch in own:
                    yield batch
        except MuxUnsupported:
            async with contextlib.aclosing(self._per_call().batches()) as per_call:
                async for batch in per_call:
                    yield batch

    def end(self, error: BaseException | None) -> None:
        if self._timer is not None:
            self._timer.cancel()
        super().end(error)

    def cancel(self) -> None:
        if not self._ended:
            self.end(rpc_error(grpc.StatusCode.CANCELLED, "Locally cancelled"))
            self.mux.cancel(self.stream_id)

    def _expire(self) -> None:
        self._timer = None
        if not self._ended:
            self.end(rpc_error(grpc.StatusCode.DEADLINE_EXCEEDED, "Deadline Exceeded"))
            self.mux.cancel(self.stream_id)


class WorkerMux:
    """One GenerateMux call to the worker at `address`: a writer that sends the requests and
    cancels gathered since its last write as one frame, and a reader that hands each response
    to its stream. `broken` is set once the call has ended; the mux is then replaced."""

    def __init__(self, channels: WorkerChannels, address: str) -> None:
        self.address = address
        self.broken = False
        self.unsupported = False  # the worker answered UNIMPLEMENTED
        self._frames = 0  # down-frames received
        self._call = channels.stub(address).GenerateMux()
        self._streams: dict[int, MuxedCall] = {}
        self._ids = itertools.count(1)
        self._requests: list[pb.MuxRequest] = []
        self._cancels: list[int] = []
        self._wake = asyncio.Event()
        self._idle: asyncio.TimerHandle | None = None
        self._writer = asyncio.create_task(self._write())
        self._reader = asyncio.create_task(self._read())

    def open(self, request: pb.GenerateRequest, tenant: str, timeout_s: float | None,
             per_call: Callable[[], Buffered]) -> MuxedCall:
        if self._idle is not None:
            self._idle.cancel()
            self._idle = None
        sid = next(self._ids)
        stream = MuxedCall(self, sid, timeout_s, per_call)
        self._streams[sid] = stream
        up = pb.MuxRequest(stream_id=sid, request=request, tenant=tenant)
        if timeout_s is not None:
            up.timeout_s = timeout_s
        self._requests.append(up)
        self._wake.set()
        return stream

    def cancel(self, stream_id: int) -> None:
        """The gateway gave up on the stream: the worker frees it at once."""
        if self._streams.pop(stream_id, None) is not None and not self.broken:
            self._cancels.append(stream_id)
            self._wake.set()
            self._idle_later()

    def _idle_later(self) -> None:
        """The last stream just ended: close the mux if none opens within MUX_IDLE_CLOSE_S."""
        if not self._streams and self._idle is None and not self.broken:
            self._idle = asyncio.get_running_loop().call_later(MUX_IDLE_CLOSE_S,
                                                               self._close_idle)

    def _close_idle(self) -> None:
        self._idle = None
        if not self._streams:
            self._break(None, "idle")

    def close(self) -> None:
        self._break(None, "the gateway is closing")

    async def _write(self) -> None:
        trace_hops = hop_trace.enabled()
        try:
            while True:
                await self._wake.wait()
                self._wake.clear()
                while self._requests or self._cancels:
                    frame = self._take()
                    if trace_hops:  # the request's hop split where it waits (hop_trace)
                        for up in frame.requests:
                            hop_trace.mark("gateway_write", up.request.request_id)
                    await self._call.write(frame)
        except grpc.aio.AioRpcError as exc:
            self._break(exc, "")
        except Exception as exc:  # noqa: BLE001 - the call ended: the reader has its status
            if not self._call.done():
                self._break(None, f"write failed: {exc!r}")

    def _take(self) -> pb.MuxUp:
        """The next up-frame: every cancel, and the gathered requests up to
        MAX_UP_FRAME_BYTES (the rest follow in the next frames)."""
        frame = pb.MuxUp(cancels=self._cancels)
        self._cancels = []
        size, n = frame.ByteSize(), 0
        for req in self._requests:
            size += req.ByteSize() + 8  # the field's tag and length
            if n and size > MAX_UP_FRAME_BYTES:
                break
            n += 1
        frame.requests.extend(self._requests[:n])
        del self._requests[:n]
        return frame

    async def _read(self) -> None:
        try:
            async for down in self._call:
                self._frames += 1
                streams = self._streams
                for item in down.items:
                    stream = streams.get(item.stream_id)
                    if stream is not None:
                        stream.put(item.response)
                for end in down.ends:
                    stream = streams.pop(end.stream_id, None)
                    if stream is not None:
                        stream.end(None if not end.code else rpc_error(
                            CODES.get(end.code, grpc.StatusCode.UNKNOWN), end.message,
                            tuple(end.trailing.items())))
                if down.ends:
                    self._idle_later()
        except grpc.aio.AioRpcError as exc:
            self._break(exc, "")
        except Exception as exc:  # noqa: BLE001 - a broken mux fails its streams, never the loop
            self._break(None, f"read failed: {exc!r}")
        else:
            self._break(None, "the worker ended the stream")

    def _break(self, exc: grpc.aio.AioRpcError | None, why: str) -> None:
        if self.broken:
            return
        self.broken = True
        if self._idle is not None:
            self._idle.cancel()
            self._idle = None
        self.unsupported = exc is not None and exc.code() == grpc.StatusCode.UNIMPLEMENTED
        # grpc.aio overwrites the status of a stream-stream call with INTERNAL ("Internal
        # error from Core") when a write fails because the call has just ended
        # (grpc/grpc#36066): a worker without GenerateMux, whose UNIMPLEMENTED came as the
        # first frame went up, read as INTERNAL in about 1% of first requests here. Before
        # any down-frame no stream has an answer, so they all go per call, where the truth
        # shows (served, or the per-call error); the worker is not marked: its next mux says
        # UNIMPLEMENTED, or works.
        lost_status = (exc is not None and exc.code() == grpc.StatusCode.INTERNAL
                       and not self._frames)
        if exc is not None:
            why = f"{exc.code().name}: {exc.details()}"
        error: BaseException = (
            MuxUnsupported(why) if self.unsupported or lost_status else rpc_error(
                grpc.StatusCode.UNAVAILABLE, f"the stream to worker {self.address} broke ({why})"))
        streams, self._streams = self._streams, {}
        if streams:
            log.info("mux to %s broke with %d streams in flight: %s", self.address,
                     len(streams), why)
        for stream in streams.values():
            stream.end(error)
        self._call.cancel()
        for task in (self._writer, self._reader):
            if task is not asyncio.current_task():
                task.cancel()


class Upstreams:
    """How this gateway process calls its workers: one Generate call per request (`mux_from`
    None), or over one mux per worker address (opened at first use, reopened after it
    breaks) once this process has `mux_from` streams in flight on the worker: 0 always
    (`slora gateway --upstream mux`), N > 0 per call below N (`--upstream auto`). The mux
    saves a busy worker front a call a request and a message a stream a step, while a single
    call was faster at light load on an H100 host (docs/performance.md). Both give a
    `Buffered` the router reads the same way."""

    def __init__(self, channels: WorkerChannels, mux_from: int | None = None) -> None:
        if mux_from is not None and mux_from < 0:
            raise ValueError(f"mux_from must be None or at least 0, got {mux_from}")
        self.channels = channels
        self.mux_from = mux_from
        self._muxes: dict[str, WorkerMux] = {}
        self._per_call_until: dict[str, float] = {}  # address -> when to try its mux again

    def open(self, address: str, request: pb.GenerateRequest, tenant: str,
             deadline: float | None, in_flight: int = 0) -> Buffered:
        """`request` to the worker at `address`; `deadline`: time.monotonic()'s, or None;
        `in_flight`: this process's streams on that worker already (see `mux_from`)."""
        def per_call() -> Buffered:
            return DrainedCall(self.channels.stub(address).Generate(
                request, timeout=None if deadline is None else deadline - time.monotonic(),
                metadata=((TENANT_HEADER, tenant),)))

        mux = (self._mux(address) if self.mux_from is not None and in_flight >= self.mux_from
               else None)
        # 1 KiB of room for what the MuxRequest adds (stream id, tenant, deadline).
        if mux is None or request.ByteSize() > MAX_UP_FRAME_BYTES - 1024:
            return per_call()
        timeout = None if deadline is None else deadline - time.monotonic()
        return mux.open(request, tenant, timeout, per_call)

    def _mux(self, address: str) -> WorkerMux | None:
        mux = self._muxes.get(address)
        if mux is not None and mux.unsupported:
            self._per_call_until[address] = time.monotonic() + PER_CALL_RETRY_S
            del self._muxes[address]
            log.warning("worker %s does not serve GenerateMux: calling it per request",
                        address)
        until = self._per_call_until.get(address)
        if until is not None:
            if time.monotonic() < until:
                return None
            del self._per_call_until[address]
        if mux is None or mux.broken:
            mux = self._muxes[address] = WorkerMux(self.channels, address)
        return mux

    async def close(self) -> None:
        """At shutdown: end every mux, then close the channels."""
        for mux in self._muxes.values():
            mux.close()
        self._muxes.clear()
        await self.channels.close()
