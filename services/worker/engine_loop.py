"""The engine on its own thread: the only thread that ever calls the engine.

Requests and other commands come in through a queue; each request's outputs go back to the
asyncio loop that asked, through its own asyncio.Queue (`loop.call_soon_threadsafe`).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeVar

from services.worker.metrics import WorkerMetrics
from slora_core.engine import LLMEngine
from slora_core.outputs import RequestOutput
from slora_core.sampling_params import SamplingParams

log = logging.getLogger(__name__)
T = TypeVar("T")
# How long the idle loop sleeps between looks at the command queue; commands wake it at once.
IDLE_WAIT_S = 0.5


@dataclass
class Subscriber:
    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue[RequestOutput | BaseException]
    submitted: float
    started: bool = False


class EngineLoop:
    """Runs `engine.step()` whenever there is work; everything else is a queued command."""

    def __init__(self, engine: LLMEngine, metrics: WorkerMetrics) -> None:
        self.engine = engine
        self.metrics = metrics
        self._commands: queue.SimpleQueue[Callable[[], None] | None] = queue.SimpleQueue()
        self._subs: dict[str, Subscriber] = {}
        self._thread = threading.Thread(target=self._run, name="engine", daemon=True)
        self._stopped = False

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        """Stop after the commands queued so far; running requests are dropped."""
        self._commands.put(None)
        self._thread.join(timeout=10)

    @property
    def num_inflight(self) -> int:
        return len(self._subs)

    # ---- called from the asyncio loop ---------------------------------------------------
    def submit(self, request_id: str, prompt: str | list[int], params: SamplingParams,
               adapter: str | None, tenant: str = "",
               ) -> asyncio.Queue[RequestOutput | BaseException]:
        """Queue a request; its outputs (or the exception that refused it) arrive on the
        returned queue, the last output having `finished=True`."""
        loop = asyncio.get_running_loop()
        q: asyncio.Queue[RequestOutput | BaseException] = asyncio.Queue()
        sub = Subscriber(loop, q, time.monotonic())
        self._commands.put(lambda: self._add(request_id, sub, prompt, params, adapter, tenant))
        return q

    def abort(self, request_id: str) -> None:
        """Abort a request now: its pages are freed by the next command the thread runs."""
        self._commands.put(lambda: self._abort(request_id))

    def call(self, fn: Callable[[LLMEngine], T]) -> concurrent.futures.Future[T]:
        """Run `fn(engine)` on the engine thread; await it with `asyncio.wrap_future`."""
        fut: concurrent.futures.Future[T] = concurrent.futures.Future()

        def run() -> None:
            if not fut.set_running_or_notify_cancel():
                return
            try:
                fut.set_result(fn(self.engine))
            except BaseException as exc:  # handed to the caller, not swallowed
                fut.set_exception(exc)

        self._commands.put(run)
        return fut

    # ---- the engine thread --------------------------------------------------------------
    def _add(self, request_id: str, sub: Subscriber, prompt: str | list[int],
             params: SamplingParams, adapter: str | None, tenant: str) -> None:
        try:
            self.engine.add_request(request_id, prompt, params, adapter=adapter, tenant=tenant)
        except Exception as exc:
            sub.loop.call_soon_threadsafe(sub.queue.put_nowait, exc)
            return
        self._subs[request_id] = sub

    def _abort(self, request_id: str) -> None:
        sub = self._subs.pop(request_id, None)
        if self.engine.abort_request(request_id) is not None:
            self.metrics.aborts.inc()
        if sub is not None:
            self._publish_state()

    def _run(self) -> None:
        while True:
            if not self._drain(block=not self.engine.has_unfinished()):
                return
            if self.engine.has_unfinished():
                self._step()

    def _drain(self, block: bool) -> bool:
        """Run queued commands (waiting for one when `block`); False once asked to stop."""
        try:
            cmd = self._commands.get(timeout=IDLE_WAIT_S) if block else self._commands.get_nowait()
        except queue.Empty:
            return True
        while True:
            if cmd is None:
                return False
            cmd()
            try:
                cmd = self._commands.get_nowait()
            except queue.Empty:
                return True

    def _step(self) -> None:
        try:
            outputs = self.engine.step()
        except Exception as exc:
            # A bug in a step leaves the batch in an unknown state: fail every request in it
            # (their pages are freed by abort) and keep serving new ones.
            log.exception("engine step failed")
            self._fail_all(exc)
            return
        self._note_started()
        # One wake-up per event loop and step, not one per output (a syscall and a GIL
        # hand-over each).
        batches: dict[asyncio.AbstractEventLoop, list[tuple[asyncio.Queue, RequestOutput]]] = {}
        for out in outputs:
            sub = self._subs.get(out.request_id)
            if sub is None:
                continue
            if out.finished:
                del self._subs[out.request_id]
            batches.setdefault(sub.loop, []).append((sub.queue, out))
        for loop, items in batches.items():
            loop.call_soon_threadsafe(_deliver, items)
        self._publish_state()

    def _note_started(self) -> None:
        now = time.monotonic()
        for seq in self.engine.scheduler.running:
            sub = self._subs.get(seq.request_id)
            if sub is not None and not sub.started:
                sub.started = True
                self.metrics.queue_time.observe(now - sub.submitted)

    def _fail_all(self, exc: Exception) -> None:
        for request_id, sub in list(self._subs.items()):
            self.engine.abort_request(request_id)
            sub.loop.call_soon_threadsafe(sub.queue.put_nowait, exc)
        self._subs.clear()
        self._publish_state()

    def _publish_state(self) -> None:
        e = self.engine
        self.metrics.set_engine_state(
            running=e.num_running, waiting=e.num_waiting, kv_pages=e.pool.num_kv_pages,
            adapter_pages=e.pool.num_adapter_pages, free_pages=e.pool.num_free,
            loads=e.stats.adapter_loads, evictions=e.stats.adapter_evictions,
        )


def _deliver(items: list[tuple[asyncio.Queue, RequestOutput]]) -> None:
    for q, out in items:
        q.put_nowait(out)
