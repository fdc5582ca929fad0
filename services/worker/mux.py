"""The worker's side of `GenerateMux`: many Generate calls over one stream from a gateway.

Each request is taken by the servicer's `open` (checks, tokenizing, the hand-over to the core)
in a task of its own; from then on it has no task: its token stream calls the session when a
step brings it news, and the writer pumps the streams with news (`Pumped.pump_into`) into `MuxDown`
frames, writing one every `PUMP_BUDGET_S` of pumping: the event loop pays a few writes a step
and no task wake a stream, and a request that arrives meanwhile waits one slice of the step's
delivery, not all of it. While one frame is being written the next one's streams gather. (A
session given only `serve`, a per-request generator, runs each request in a task to its end:
the test doubles' way.)
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import time
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable
from typing import Protocol

import grpc

from services.common import errors as e
from services.common import hop_trace
from slora.v1 import inference_pb2 as pb

# One request, whichever RPC carries it: (request, tenant, seconds left of its deadline or
# None) -> its responses; raises ServiceError (anything else is a bug: INTERNAL).
Serve = Callable[[pb.GenerateRequest, str, float | None],
                 AsyncGenerator[pb.GenerateResponse, None]]


class Pumped(Protocol):
    """A request `Open` took (services/worker/servicer.py `Served`)."""

    done: bool

    # Writes its responses into the messages `new()` gives; raises the stream's ServiceError.
    def pump_into(self, new: Callable[[], pb.GenerateResponse]) -> None: ...
    def listen(self, wake: Callable[[], None]) -> None: ...
    def close(self) -> None: ...


# (request, tenant, seconds left of its deadline or None) -> the request taken.
Open = Callable[[pb.GenerateRequest, str, float | None], Awaitable[Pumped]]

# A down frame is cut at about this many bytes (the gateway accepts 64 MiB a message); the
# rest goes in the next frame.
MAX_DOWN_FRAME_BYTES = 8 * 1024 * 1024


def end_of(stream_id: int, err: e.ServiceError | None) -> pb.MuxEnd:
    """The MuxEnd saying what a per-call Generate would have ended with (None: OK)."""
    if err is None:
        return pb.MuxEnd(stream_id=stream_id)
    return pb.MuxEnd(stream_id=stream_id, code=err.code.value[0], message=str(err),
                     trailing=dict(err.metadata()))


# The writer pumps streams for about this long before it writes what it has: a request that
# arrives meanwhile waits one such slice, not a whole step's delivery (on a 2-core CPU at 256
# streams 1.8 ms p50 against 10.4 with a task a stream: front-mux-pump-f14019b-cpu.json; on
# an H100 through the gateway the p99 request TTFT added fell from 32.8 to 11.3 ms, the p50
# stayed: service-overhead-7b-gw4-front-pump-c256-3b33b95-h100.json).
PUMP_BUDGET_S = 0.0005


def deadline_exceeded() -> e.ServiceError:
    err = e.ServiceError("Deadline Exceeded")
    err.code = grpc.StatusCode.DEADLINE_EXCEEDED
    return err


class MuxSession:
    """One GenerateMux call. `frames(up)` reads the gateway's frames from `up` and yields the
    down frames; when it ends (the gateway closed the stream, or it broke), every request
    still running is cancelled, which frees it in the engine core."""

    def __init__(self, serve: Serve, open_: Open | None = None) -> None:
        self._serve = serve
        self._open = open_
        self._tasks: dict[int, asyncio.Task[None]] = {}  # requests being taken (or served)
        self._pumped: dict[int, Pumped] = {}  # requests taken, by stream id
        self._timers: dict[int, asyncio.TimerHandle] = {}  # their deadlines
        self._due: dict[int, Pumped] = {}  # streams with news, in the order they had it
        # The next down frame, its items written in place as streams are pumped.
        self._frame = pb.MuxDown()
        self._ready = asyncio.Event()
        self._up_closed = False
        self.pump_budget_s = PUMP_BUDGET_S

    async def frames(self, up: AsyncIterator[pb.MuxUp]) -> AsyncIterator[pb.MuxDown]:
        reader = asyncio.create_task(self._read(up))
        try:
            while True:
                await self._ready.wait()
                self._ready.clear()
                while True:
                    self._pump_due(self.pump_budget_s)
                    if not (self._frame.items or self._frame.ends):
                        break
                    yield self._take()
                    if self._tasks:
                        # Requests being taken (closed-loop successors, often): their
                        # hand-over to the core runs before the next slice is pumped.
                        await asyncio.sleep(0)
                if reader.done():
                    reader.result()  # a broken up-stream raises here
                    if not self._tasks and not self._pumped:
                        return
        finally:
            reader.cancel()
            for task in list(self._tasks.values()):
                task.cancel()
            for sid in list(self._pumped):
                self._drop(sid)

    async def _read(self, up: AsyncIterator[pb.MuxUp]) -> None:
        trace_hops = hop_trace.enabled()
        try:
            async for frame in up:
                if trace_hops:  # the gateway -> worker hop split where it waits (hop_trace)
                    for req in frame.requests:
                        hop_trace.mark("worker_mux_in", req.request.request_id)
                for sid in frame.cancels:
                    task = self._tasks.pop(sid, None)
                    if task is not None:
                        task.cancel()
                    self._drop(sid)
                for req in frame.requests:
                    if req.stream_id in self._tasks or req.stream_id in self._pumped:
                        continue  # a gateway bug; the first stream keeps its id
                    run = self._run if self._open is None else self._take_over
                    self._tasks[req.stream_id] = asyncio.create_task(run(req))
        finally:
            self._up_closed = True
            self._ready.set()

    async def _take_over(self, req: pb.MuxRequest) -> None:
        """Open the request (its deadline counting), then hand it to the pump and end."""
        assert self._open is not None
        sid = req.stream_id
        timeout = req.timeout_s if req.HasField("timeout_s") else None
        deadline = None if timeout is None else asyncio.get_running_loop().time() + timeout
        try:
            async with asyncio.timeout_at(deadline):
                served = await self._open(req.request, req.tenant, timeout)
        except TimeoutError:
            return self._end(sid, deadline_exceeded())
        except Exception as exc:  # noqa: BLE001 - the stream's own end, as per-call would say
            return self._end(sid, e.as_service_error(exc))
        if self._tasks.pop(sid, None) is None:  # cancelled as `open` returned
            served.close()
            return None
        self._pumped[sid] = served
        if deadline is not None:
            self._timers[sid] = asyncio.get_running_loop().call_at(deadline, self._expire, sid)
        served.listen(lambda: self._wake(sid, served))
        return None

    def _wake(self, sid: int, served: Pumped) -> None:
        self._due[sid] = served
        self._ready.set()

    def _pump_due(self, budget_s: float) -> None:
        """Streams with news into the pending items, and the end of each that has ended: as
        many as `budget_s` of the loop's time allows (at least one; 0: all), the rest after
        this frame's write."""
        due, items = self._due, self._frame.items
        until = time.perf_counter() + budget_s if budget_s else math.inf
        while due:
            sid = next(iter(due))
            served = due.pop(sid)
            if self._pumped.get(sid) is not served:
                continue  # cancelled or expired since
            try:
                # Called within this turn of the loop, so `sid` is this stream's.
                served.pump_into(lambda: items.add(stream_id=sid).response)  # noqa: B023
            except Exception as exc:  # noqa: BLE001 - the stream's own end
                self._drop(sid)
                self._frame.ends.append(end_of(sid, e.as_service_error(exc)))
                continue
            if served.done:
                self._drop(sid)
                self._frame.ends.append(end_of(sid, None))
            if due and time.perf_counter() > until:
                self._ready.set()
                return

    def _expire(self, sid: int) -> None:
        self._timers.pop(sid, None)
        if sid in self._pumped:
            self._drop(sid)
            self._frame.ends.append(end_of(sid, deadline_exceeded()))
            self._ready.set()

    def _drop(self, sid: int) -> None:
        """Forget a taken stream and free it (its end, if it has one, is the caller's)."""
        served = self._pumped.pop(sid, None)
        timer = self._timers.pop(sid, None)
        if timer is not None:
            timer.cancel()
        if served is not None:
            served.close()

    def _end(self, sid: int, err: e.ServiceError | None) -> None:
        """A stream's end, unless the gateway cancelled it meanwhile (it wants none)."""
        if self._tasks.pop(sid, None) is not None:
            self._frame.ends.append(end_of(sid, err))
            self._ready.set()

    async def _run(self, req: pb.MuxRequest) -> None:
        sid = req.stream_id
        timeout = req.timeout_s if req.HasField("timeout_s") else None
        err: e.ServiceError | None = None
        try:
            async with contextlib.aclosing(self._serve(req.request, req.tenant, timeout)) as rs:
                async with asyncio.timeout(timeout):
                    async for r in rs:
                        self._frame.items.add(stream_id=sid).response.CopyFrom(r)
                        self._ready.set()
        except TimeoutError:
            err = deadline_exceeded()
        except Exception as exc:  # noqa: BLE001 - the stream's own end, as per-call would say
            err = e.as_service_error(exc)
        self._end(sid, err)

    def _take(self) -> pb.MuxDown:
        """The next frame: every pending item and end, or, past MAX_DOWN_FRAME_BYTES (large
        prompt logprobs), the first half of the items (the rest, and the ends, follow)."""
        frame = self._frame
        if len(frame.items) < 2 or frame.ByteSize() <= MAX_DOWN_FRAME_BYTES:
            self._frame = pb.MuxDown()
            return frame
        half = len(frame.items) // 2
        self._frame = pb.MuxDown(items=frame.items[half:], ends=frame.ends)
        return pb.MuxDown(items=frame.items[:half])
