"""The front's handle on its engine-core process: start it, feed it, route its step outputs.

One reader task takes each `StepOutput` and appends every request's new tokens to that request's
`TokenStream`, waking the stream's consumer once per step (a consumer that falls behind finds
several tokens waiting and sends them as one chunk). Commands (`call`) are answered through the
same output socket. If the core process dies, every stream and pending call ends with
`UNAVAILABLE` at once and `on_death` runs (the worker then exits non-zero for its supervisor).
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import multiprocessing
import os
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import grpc
import zmq
import zmq.asyncio

from services.common import errors as e
from services.common import hop_trace
from services.common.structured import to_wire
from services.worker import core_protocol as m
from services.worker.engine_core import CoreSpec, run_engine_core
from services.worker.errors import QUEUE_RETRY_AFTER_MS
from slora_core.config import EngineConfig
from slora_core.sampling_params import SamplingParams
from slora_core.structured.spec import StructuredOutput

log = logging.getLogger(__name__)
STOP_TIMEOUT_S = 10.0


class TokenStream:
    """One request's tokens as they arrive from the core; `finish` is set once, last."""

    __slots__ = ("token_ids", "logprobs", "top", "finish", "submitted", "event", "prompt",
                 "cached_tokens", "streamed", "listener")

    def __init__(self) -> None:
        self.token_ids: list[int] = []
        self.logprobs: list[float] = []
        self.top: list[list[tuple[int, float]]] = []
        self.finish: m.Finish | None = None
        # Prompt logprobs (positions 1, 2, ...): (token id, logprob, top alternatives).
        self.prompt: list[tuple[int, float, list[tuple[int, float]]]] = []
        self.submitted = time.monotonic()
        self.event = asyncio.Event()
        self.cached_tokens = 0  # prompt tokens the core's prefix cache served (StepOutput.cached)
        self.streamed = False  # a token has arrived (the first one is woken ahead of the rest)
        # Called at each wake beside the event: a consumer without a task of its own (a
        # GenerateMux stream, services/worker/mux.py) is told here that it has news.
        self.listener: Callable[[], None] | None = None

    def wake(self) -> None:
        self.event.set()
        if self.listener is not None:
            self.listener()

    def take(self) -> tuple[list[int], list[float], list[list[tuple[int, float]]]]:
        """Everything that arrived since the last take."""
        out = self.token_ids, self.logprobs, self.top
        self.token_ids, self.logprobs, self.top = [], [], []
        self.event.clear()
        return out


def sampling_msg(p: SamplingParams) -> m.SamplingMsg:
    return m.SamplingMsg.of(p)


def add_prompt_scores(s: TokenStream, scores: m.PromptScores) -> None:
    """Append the positions `s` lacks (a preempted request prefills, and scores, again)."""
    skip = len(s.prompt) + 1 - scores.start
    for j in range(max(0, skip), len(scores.token_ids)):
        s.prompt.append((scores.token_ids[j], scores.logprobs[j], scores.top[j]))


def error_of(code: str, message: str, adapter_error: bool = False) -> e.ServiceError:
    """The ServiceError the core reported by status name (a full queue keeps its retry hint)."""
    status = getattr(grpc.StatusCode, code, grpc.StatusCode.INTERNAL)
    retry = QUEUE_RETRY_AFTER_MS if status == grpc.StatusCode.RESOURCE_EXHAUSTED else None
    err = e.ServiceError(message, adapter_error=adapter_error, retry_after_ms=retry)
    err.code = status
    return err


class CoreClient:
    def __init__(self, model_dir: Path, config: EngineConfig,
                 on_death: Callable[[str], None] = lambda _why: None,
                 on_step: Callable[[m.StepOutput], None] = lambda _out: None,
                 on_started: Callable[[float], None] = lambda _queued_s: None,
                 step_delay_s: float = 0.0, compile_cache_dir: Path | None = None,
                 on_startup: Callable[[m.StartupUpdate], None] = lambda _update: None,
                 graphs_in_background: bool = False) -> None:
        self.model_dir = model_dir
        self.config = config
        self.compile_cache_dir = compile_cache_dir  # startup.compile_cache_root; None: none
        self.graphs_in_background = graphs_in_background  # CoreSpec.graphs_in_background
        self.step_delay_s = step_delay_s  # test hook (debug_hooks.STEP_DELAY_ENV)
        self.on_death = on_death
        self.on_step = on_step
        self.on_started = on_started  # a request left the core's queue after so many seconds
        self.on_startup = on_startup  # start-up work the core finished after Ready
        self.streams: dict[int, TokenStream] = {}
        self.state = m.EngineState()
        self.ready: m.Ready | None = None
        self.dead: str | None = None
        self._calls: dict[int, asyncio.Future[Any]] = {}
        self._ids = itertools.count(1)
        self._dir = tempfile.TemporaryDirectory(prefix="slora-core-")
        self._ctx = zmq.asyncio.Context()
        self._sync_ctx = zmq.Context()
        self._proc: multiprocessing.process.BaseProcess | None = None
        self._reader: asyncio.Task[None] | None = None
        self._closing = False

    # ---- life cycle ---------------------------------------------------------------------
    async def start(self) -> None:
        """Spawn the core and wait until it has loaded the model and warmed up. Must run on
        the main thread: the core dies with the thread that started it (PR_SET_PDEATHSIG)."""
        base = Path(self._dir.name)
        self._inputs = self._sync_ctx.socket(zmq.PUSH)
        self._inputs.setsockopt(zmq.SNDHWM, 0)
        self._inputs.setsockopt(zmq.LINGER, 0)
        self._inputs.bind(f"ipc://{base / 'in'}")
        self._outputs = self._ctx.socket(zmq.PULL)
        self._outputs.setsockopt(zmq.RCVHWM, 0)
        self._outputs.bind(f"ipc://{base / 'out'}")
        spec = CoreSpec(self.model_dir, self.config, f"ipc://{base / 'in'}",
                        f"ipc://{base / 'out'}", logging.getLevelName(log.getEffectiveLevel()),
                        self.step_delay_s, self.compile_cache_dir, spawned_at=time.time(),
                        graphs_in_background=self.graphs_in_background)
        proc = multiprocessing.get_context("spawn").Process(
            target=run_engine_core, args=(spec, os.getpid()), name="slora-engine-core")
        proc.start()
        self._proc = proc
        loop = asyncio.get_running_loop()
        loop.add_reader(proc.sentinel, self._on_exit)
        self._reader = asyncio.create_task(self._read())
        while self.ready is None:
            if self.dead is not None:
                raise RuntimeError(self.dead)
            await asyncio.sleep(0.02)

    async def close(self) -> None:
        """Ask the core to stop and wait for it (killing it after STOP_TIMEOUT_S)."""
        self._closing = True
        proc = self._proc
        if proc is not None and proc.exitcode is None:
            self._send(m.Shutdown())
            await asyncio.to_thread(proc.join, STOP_TIMEOUT_S)
            if proc.exitcode is None:
                proc.kill()
                await asyncio.to_thread(proc.join, 2)
        if proc is not None:
            asyncio.get_running_loop().remove_reader(proc.sentinel)
        if self._reader is not None:
            self._reader.cancel()
        self._inputs.close(linger=0)
        self._outputs.close(linger=0)
        self._dir.cleanup()

    @property
    def pid(self) -> int | None:
        return None if self._proc is None else self._proc.pid

    # ---- requests and commands ----------------------------------------------------------
    def add(self, prompt_token_ids: list[int], params: SamplingParams, adapter: str | None,
            tenant: str = "", deadline_s: float | None = None,
            structured: StructuredOutput | None = None) -> tuple[int, TokenStream]:
        """Queue a request in the core; its tokens arrive on the returned stream."""
        if self.dead is not None:
            raise e.Unavailable(self.dead)
        rid = next(self._ids)
        stream = TokenStream()
        self.streams[rid] = stream
        self._send(m.AddRequest(rid, prompt_token_ids, sampling_msg(params), adapter, tenant,
                                deadline_s, structured=to_wire(structured)))
        return rid, stream

    def abort(self, rid: int) -> bool:
        """Stop a request now (its pages are freed by the core's next loop turn); False when
        it had already ended."""
        if self.streams.pop(rid, None) is None or self.dead is not None:
            return False
        self._send(m.Abort([rid]))
        return True

    async def call(self, method: str, *args: Any) -> Any:
        """Run a command in the core (see engine_core.Commands); raises its ServiceError."""
        if self.dead is not None:
            raise e.Unavailable(self.dead)
        cid = next(self._ids)
        fut: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        self._calls[cid] = fut
        self._send(m.Call(cid, method, list(args)))
        try:
            return await fut
        finally:
            self._calls.pop(cid, None)

    def _send(self, msg: m.ToCore) -> None:
        self._inputs.send(m.encoder.encode(msg), copy=False)

    # ---- outputs ------------------------------------------------------------------------
    async def _read(self) -> None:
        while True:
            frame = await self._outputs.recv(copy=False)
            msg = m.from_core_decoder.decode(frame.buffer)
            if isinstance(msg, m.StepOutput):
                await self._deliver(msg)
            elif isinstance(msg, m.CallResult):
                self._answer(msg)
            elif isinstance(msg, m.StartupUpdate):
                self.on_startup(msg)
            else:
                self.ready = msg

    async def _deliver(self, out: m.StepOutput) -> None:
        """A step's tokens to their streams: the consumers of first tokens and of finished
        requests run a loop turn ahead of the rest, so a GenerateMux writer (woken by them)
        sends those in a frame of their own instead of after every running stream's chunk
        (services/worker/mux.py). A finished request's end is what a closed-loop client waits
        for before its next request: behind 256 running streams' chunks it reached the
        gateway ~8 ms after it left the front on an H100
        (service-overhead-7b-gw4-end-trace-410632a-h100.json). Per call, each consumer writes
        its own stream and the turn only starts the ahead streams' writes first."""
        first, rest = self._dispatch(out)
        if first and rest:
            await asyncio.sleep(0)
        for s in rest:
            if s.token_ids:  # a consumer that ran in that turn took them: nothing to wake for
                s.wake()

    def _dispatch(self, out: m.StepOutput) -> tuple[int, list[TokenStream]]:
        """Append a step's output to its streams and wake those whose first token it holds,
        then those it finishes; returns how many it woke and the other streams to wake."""
        streams = self.streams
        woken: dict[int, TokenStream] = {}
        first: list[TokenStream] = []  # streams whose first token this is
        tops = out.top
        for i, rid in enumerate(out.rids):
            s = streams.get(rid)
            if s is None:
                continue  # aborted by the front meanwhile
            s.token_ids.append(out.token_ids[i])
            s.logprobs.append(out.logprobs[i])
            if tops is not None:
                s.top.append(tops[i])
            if not s.streamed:
                s.streamed = True
                hop_trace.mark("worker_first_in", rid)
                first.append(s)
            else:
                woken[rid] = s
        for rid, n in out.cached:
            s = streams.get(rid)
            if s is not None:
                s.cached_tokens = n
        for scores in out.prompt:
            s = streams.get(scores.rid)
            if s is not None:
                add_prompt_scores(s, scores)
        if out.started:
            now = time.monotonic()
            for rid in out.started:
                s = streams.get(rid)
                if s is not None:
                    self.on_started(now - s.submitted)
        # Consumers resume in the order their events are set, and each one's chunk costs the
        # event loop tens of microseconds: first tokens go ahead of the rest of the step's
        # (a new request's TTFT would otherwise wait behind every running stream's token).
        for s in first:
            s.wake()
        ahead = len(first)
        for fin in out.finished:
            s = streams.pop(fin.rid, None)
            if s is not None:
                s.finish = fin
                woken.pop(fin.rid, None)
                if not s.event.is_set():  # not woken already (as a first token)
                    s.wake()
                    ahead += 1
        rest = list(woken.values())
        if out.state.warm_adapters is None:
            out.state.warm_adapters = self.state.warm_adapters
        self.state = out.state
        self.on_step(out)
        return ahead, rest

    def _answer(self, res: m.CallResult) -> None:
        fut = self._calls.get(res.cid)
        if fut is None or fut.done():
            return
        if res.code:
            fut.set_exception(error_of(res.code, res.error, res.adapter_error))
        else:
            fut.set_result(res.value)

    def _on_exit(self) -> None:
        """The core process ended: fail everything in flight at once."""
        proc = self._proc
        assert proc is not None
        asyncio.get_running_loop().remove_reader(proc.sentinel)
        proc.join(1.0)  # the sentinel fires as it exits; reaping it may take a moment
        why = f"the engine core exited (code {proc.exitcode})"
        self.dead = why
        if self._closing:
            return
        log.error("%s; failing %d requests", why, len(self.streams))
        for rid, s in self.streams.items():
            s.finish = m.Finish(rid, "error", why, "UNAVAILABLE")
            s.wake()
        self.streams.clear()
        for fut in self._calls.values():
            if not fut.done():
                fut.set_exception(e.Unavailable(why))
        self.on_death(why)
