"""The worker's side of `GenerateMux`: many Generate calls over one stream from a gateway.

Each request runs the same per-request generator a per-call `Generate` runs (`Serve`), in a
task of its own; the writer sends everything the tasks produced since its previous write as
one `MuxDown` frame. While one frame is being written the next one fills, so under load a
frame carries an engine step's tokens for every stream, and the event loop pays one write
per step instead of one per stream.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncGenerator, AsyncIterator, Callable

import grpc

from services.common import errors as e
from services.common import hop_trace
from slora.v1 import inference_pb2 as pb

# One request, whichever RPC carries it: (request, tenant, seconds left of its deadline or
# None) -> its responses; raises ServiceError (anything else is a bug: INTERNAL).
Serve = Callable[[pb.GenerateRequest, str, float | None],
                 AsyncGenerator[pb.GenerateResponse, None]]

# A down frame is cut at about this many bytes (the gateway accepts 64 MiB a message); the
# rest goes in the next frame.
MAX_DOWN_FRAME_BYTES = 8 * 1024 * 1024


def end_of(stream_id: int, err: e.ServiceError | None) -> pb.MuxEnd:
    """The MuxEnd saying what a per-call Generate would have ended with (None: OK)."""
    if err is None:
        return pb.MuxEnd(stream_id=stream_id)
    return pb.MuxEnd(stream_id=stream_id, code=err.code.value[0], message=str(err),
                     trailing=dict(err.metadata()))


class MuxSession:
    """One GenerateMux call. `frames(up)` reads the gateway's frames from `up` and yields the
    down frames; when it ends (the gateway closed the stream, or it broke), every request
    still running is cancelled, which frees it in the engine core."""

    def __init__(self, serve: Serve) -> None:
        self._serve = serve
        self._tasks: dict[int, asyncio.Task[None]] = {}
        self._items: list[pb.MuxItem] = []
        self._ends: list[pb.MuxEnd] = []
        self._ready = asyncio.Event()
        self._up_closed = False

    async def frames(self, up: AsyncIterator[pb.MuxUp]) -> AsyncIterator[pb.MuxDown]:
        reader = asyncio.create_task(self._read(up))
        try:
            while True:
                await self._ready.wait()
                self._ready.clear()
                while self._items or self._ends:
                    yield self._take()
                if reader.done():
                    reader.result()  # a broken up-stream raises here
                    if not self._tasks:
                        return
        finally:
            reader.cancel()
            for task in list(self._tasks.values()):
                task.cancel()

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
                for req in frame.requests:
                    if req.stream_id in self._tasks:
                        continue  # a gateway bug; the first stream keeps its id
                    self._tasks[req.stream_id] = asyncio.create_task(self._run(req))
        finally:
            self._up_closed = True
            self._ready.set()

    async def _run(self, req: pb.MuxRequest) -> None:
        sid = req.stream_id
        timeout = req.timeout_s if req.HasField("timeout_s") else None
        err: e.ServiceError | None = None
        try:
            async with contextlib.aclosing(self._serve(req.request, req.tenant, timeout)) as rs:
                async with asyncio.timeout(timeout):
                    async for r in rs:
                        self._items.append(pb.MuxItem(stream_id=sid, response=r))
                        self._ready.set()
        except TimeoutError:
            err = e.ServiceError("Deadline Exceeded")
            err.code = grpc.StatusCode.DEADLINE_EXCEEDED
        except Exception as exc:  # noqa: BLE001 - the stream's own end, as per-call would say
            err = e.as_service_error(exc)
        if self._tasks.pop(sid, None) is None:
            return  # cancelled by the gateway meanwhile: it wants no end
        self._ends.append(end_of(sid, err))
        self._ready.set()

    def _take(self) -> pb.MuxDown:
        """The next frame: every pending item and end, or, past MAX_DOWN_FRAME_BYTES (large
        prompt logprobs), the first half of the items (the rest, and the ends, follow)."""
        frame = pb.MuxDown(items=self._items, ends=self._ends)
        if len(self._items) < 2 or frame.ByteSize() <= MAX_DOWN_FRAME_BYTES:
            self._items, self._ends = [], []
            return frame
        half = len(self._items) // 2
        first, self._items = self._items[:half], self._items[half:]
        return pb.MuxDown(items=first)
