"""The engine-core process: owns the device and runs the step loop, never waiting on the front.

Started by the front (`core_client.CoreClient`) with multiprocessing's spawn; connects two ZeroMQ
sockets the front has bound (requests in, step outputs out). Each loop turn takes every message
already waiting, then runs one engine step and sends one `StepOutput` with every request's new
tokens. It exits when asked, when its input says the front closed, or when the front process is
gone (a PR_SET_PDEATHSIG signal on Linux, and a parent-pid check as a fallback), so no orphan
keeps the GPU.
"""

from __future__ import annotations

import concurrent.futures
import logging
import os
import queue
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import zmq

from services.common import hop_trace
from services.common.structured import from_wire
from services.worker import core_protocol as m
from services.worker.errors import to_service_error
from services.worker.startup import BackgroundGraphs, start_timed
from slora_core.config import EngineConfig
from slora_core.launch import AnyEngine
from slora_core.outputs import ADAPTER_UNLOADABLE, DEADLINE, RequestOutput
from slora_core.process import die_with_parent, freeze_startup_heap, share_cpu_threads
from slora_core.structured.requests import GRAMMAR_ERROR

log = logging.getLogger(__name__)
# How long an idle core waits for input before it looks at background work and its parent.
IDLE_POLL_MS = 200
# While adapter loads run in the background, idle polls are short so their results go out soon.
BUSY_POLL_MS = 5
# How often the state sent with step outputs lists the warm adapters (heartbeats report them).
WARM_EVERY_S = 0.5
# An idle engine is told to keep its other ranks alive this often (tensor parallelism: their
# pending receive must complete within the collective timeout).
KEEPALIVE_EVERY_S = 60.0
# How often a worker with late admission logs what its pacing cost the GPU (s).
PACER_LOG_EVERY_S = 10.0
# Commands that parse adapter files: run on a thread so they overlap engine steps.
BACKGROUND = ("load_adapter", "touch_adapters")


@dataclass(frozen=True)
class CoreSpec:
    model_dir: Path
    config: EngineConfig
    input_address: str   # the front's PUSH socket (bound by the front)
    output_address: str  # the front's PULL socket
    log_level: str = "INFO"
    step_delay_s: float = 0.0  # test hook: sleep after every step (debug_hooks.STEP_DELAY_ENV)
    # The compiled-kernel cache's root (startup.compile_cache_root); None: Triton's default.
    compile_cache_dir: Path | None = None
    spawned_at: float = 0.0  # time.time() when the front spawned this process (profile)
    # CUDA graphs captured between steps once the core serves (eagerly where a graph is
    # missing); False: every graph before Ready.
    graphs_in_background: bool = False


def run_engine_core(spec: CoreSpec, parent_pid: int) -> None:
    """Process entry point (spawned by the front)."""
    logging.basicConfig(level=spec.log_level,
                        format="%(asctime)s engine-core %(levelname)s %(name)s: %(message)s")
    die_with_parent(parent_pid)  # SIGKILL: no orphan holding the GPU
    share_cpu_threads(1)  # the host may grant fewer cores than it shows
    ctx = zmq.Context()
    inputs = ctx.socket(zmq.PULL)
    inputs.connect(spec.input_address)
    outputs = ctx.socket(zmq.PUSH)
    outputs.setsockopt(zmq.LINGER, 1000)
    outputs.connect(spec.output_address)
    # Weights, arena, a warm-up request (its kernels compiled or read from the compile cache);
    # CUDA graphs before Ready, or queued for `graphs` to capture while serving.
    engine, profile, cache = start_timed(spec.model_dir, spec.config, spec.compile_cache_dir,
                                         spec.spawned_at, spec.graphs_in_background)
    graphs = BackgroundGraphs.of(engine, profile.stats)
    freeze_startup_heap()
    outputs.send(m.encoder.encode(m.Ready(
        max_num_seqs=spec.config.max_num_seqs, max_model_len=engine.max_model_len,
        eos_token_ids=list(engine.eos_token_ids), startup=profile.records,
        compile_cache=f"{cache.path} ({cache.state})" if cache is not None else "",
        graphs_pending=graphs.pending if graphs is not None else 0)))
    try:
        EngineCore(engine, outputs, parent_pid, spec.step_delay_s, graphs).run(inputs)
        engine.close()  # a clean stop: tensor-parallel ranks leave with it
    finally:
        inputs.close(linger=0)
        outputs.close()
        ctx.term()


class EngineCore:
    """The loop: drain inputs, run one step, send its outputs; commands between steps."""

    def __init__(self, engine: AnyEngine, outputs: zmq.Socket, parent_pid: int,
                 step_delay_s: float = 0.0, graphs: BackgroundGraphs | None = None) -> None:
        self.engine = engine
        self.graphs = graphs  # CUDA graphs still to capture, one a loop turn
        self.outputs = outputs
        self.parent_pid = parent_pid
        self.step_delay_s = step_delay_s
        self.commands = Commands(engine)
        self._failed: list[m.Finish] = []     # refused requests, sent with the next output
        self._unstarted: set[int] = set()     # rids not yet scheduled
        self._added = 0  # requests the engine took, in all (late admission counts its own)
        self._last_state: m.EngineState | None = None
        self._warm_at = -WARM_EVERY_S  # when warm_adapters was last sent
        self._active_at = time.monotonic()  # last step or keepalive
        self._pacer_logged_at = time.monotonic()
        self.trace_hops = hop_trace.enabled()
        self._step_entered = 0.0  # wall clock (hop traces' core_started)
        # A step's read tokens leave as soon as they are known, before the next sampling is
        # launched and booked (StepLoop.early_outputs): a closed-loop client's next request
        # starts that much sooner, inside more of late admission's windows.
        self._sent_early = False
        engine.loop.early_outputs = self._send_early

    def run(self, inputs: zmq.Socket) -> None:
        while True:
            busy = self.engine.has_unfinished()
            capturing = self.graphs is not None and self.graphs.pending > 0
            timeout = 0 if busy or capturing else (
                BUSY_POLL_MS if self.commands.pending else IDLE_POLL_MS)
            if inputs.poll(timeout) and not self._drain(inputs):
                return
            for result in self.commands.done():
                self.outputs.send(m.encoder.encode(result))
            if self.engine.has_unfinished():
                self._step()
                if not self._admit_late(inputs):
                    return
            elif self._failed or self._state_changed():
                self._send([])
            elif os.getppid() != self.parent_pid:
                log.error("the front process is gone; exiting")
                return
            if busy or self.engine.has_unfinished():
                self._active_at = time.monotonic()
            elif time.monotonic() - self._active_at > KEEPALIVE_EVERY_S:
                self.engine.keepalive()
                self._active_at = time.monotonic()
            if capturing:
                self._capture_graph()

    def _capture_graph(self) -> None:
        """Capture one queued CUDA graph between steps (a step whose graph is not captured yet
        runs eagerly: slower, never wrong) and tell the front."""
        assert self.graphs is not None
        try:
            records = [self.graphs.capture_next()]
        except Exception:
            # Serving goes on: the graphs left stay queued, so their steps keep running
            # eagerly (slower, never wrong); none is tried again.
            log.exception("CUDA graph capture failed; %d graphs stay eager",
                          self.graphs.engine.graphs_pending())
            self.graphs.failed, records = True, []
        update = m.StartupUpdate(records, self.graphs.engine.graphs_pending())
        self.outputs.send(m.encoder.encode(update))

    def _admit_late(self, inputs: zmq.Socket) -> bool:
        """Late admission (EngineConfig.admission_lead_ms, slora_core/admission.py): while the
        step under way on the GPU leaves time before the next must be launched, take the
        requests that arrive, so that they join that next step; False once asked to shut
        down."""
        pacer = self.engine.loop.pacer
        if pacer is not None and time.monotonic() - self._pacer_logged_at > PACER_LOG_EVERY_S:
            log.info("%s", pacer.summary())
            self._pacer_logged_at = time.monotonic()
        wait = self.engine.loop.admission_wait_s()
        if self.trace_hops and pacer is not None:  # the loop's rhythm (not a request's hop)
            hop_trace.mark("loop_wait", f"{wait * 1e6:.0f}:{pacer.trace_key(time.monotonic())}")
        if wait <= 0.0:
            return True
        start, added = time.monotonic(), self._added
        deadline = start + wait
        # zmq polls whole milliseconds: the last fraction of one is polled without blocking,
        # so the wait ends where the pacer put its end (not up to 1 ms before it).
        while (left := deadline - time.monotonic()) > 0:
            if inputs.poll(int(left * 1e3)) and not self._drain(inputs):
                return False
        if pacer is not None:
            pacer.took(time.monotonic() - start, self._added - added)
        return True

    def _drain(self, inputs: zmq.Socket) -> bool:
        """Handle every message already waiting; False once asked to shut down."""
        while True:
            try:
                raw = inputs.recv(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return True
            msg = m.to_core_decoder.decode(raw.buffer)
            if isinstance(msg, m.AddRequest):
                self._add(msg)
            elif isinstance(msg, m.Abort):
                for rid in msg.rids:
                    self.engine.abort_request(str(rid))
                    self._unstarted.discard(rid)
            elif isinstance(msg, m.Call):
                self.commands.start(msg)
            else:
                return False

    def _add(self, msg: m.AddRequest) -> None:
        try:
            params = msg.sampling.params()
            self.engine.add_request(str(msg.rid), msg.prompt_token_ids, params,
                                    adapter=msg.adapter, tenant=msg.tenant,
                                    deadline_s=msg.deadline_s,
                                    structured=from_wire(msg.structured))
        except Exception as exc:
            err = to_service_error(exc)
            self._failed.append(m.Finish(msg.rid, "error", str(err), err.code.name,
                                         err.adapter_error))
            return
        self._unstarted.add(msg.rid)
        self._added += 1
        hop_trace.mark("core_added", msg.rid)

    def _step(self) -> None:
        if self.trace_hops:
            self._step_entered = time.time()
            hop_trace.mark("loop_step", self.engine.stats.steps)
        self._sent_early = False
        try:
            outs = self.engine.step()
        except Exception as exc:
            # A failed step leaves the batch in an unknown state: fail every request in it
            # (abort frees their pages) and keep serving new ones.
            log.exception("engine step failed")
            self._fail_all(exc)
            return
        if outs or self._failed or not self._sent_early:  # one message a step, as a rule
            self._send(outs)
        if self.step_delay_s:
            time.sleep(self.step_delay_s)

    def _fail_all(self, exc: Exception) -> None:
        err = to_service_error(exc)
        for rid in map(int, self.engine.request_ids()):
            self.engine.abort_request(str(rid))
            self._failed.append(m.Finish(rid, "error", str(err), err.code.name))
        self._send([])

    def _send_early(self, outs: list[RequestOutput]) -> None:
        self._send(outs)
        self._sent_early = True

    def _send(self, outs: list[RequestOutput]) -> None:
        if self.trace_hops:
            for out in outs:  # a request's first tokens: it has no others yet
                if out.token_ids and out.completion_tokens == len(out.token_ids):
                    hop_trace.mark("core_first", out.request_id)
        self.outputs.send(m.encoder.encode(self._step_output(outs)), copy=False)

    def _step_output(self, outs: list[RequestOutput]) -> m.StepOutput:
        rids: list[int] = []
        token_ids: list[int] = []
        logprobs: list[float] = []
        tops: list[list[tuple[int, float]]] = []
        cached: list[tuple[int, int]] = []
        any_top = False
        finished, self._failed = self._failed, []
        for out in outs:
            rid = int(out.request_id)
            for tok, lp in zip(out.token_ids, out.logprobs, strict=True):
                rids.append(rid)
                token_ids.append(tok)
                logprobs.append(lp.logprob)
                tops.append(list(lp.top_logprobs))
                any_top = any_top or bool(lp.top_logprobs)
            # Sent once, with the request's first tokens: the front needs it before any stop
            # string it matches ends the request there.
            if out.cached_tokens and out.token_ids and out.completion_tokens == len(
                    out.token_ids):
                cached.append((rid, out.cached_tokens))
            if out.finished:
                self._unstarted.discard(rid)
                finished.append(finish_of(rid, out))
                if self.trace_hops:
                    hop_trace.mark("core_finish", rid)
        prompt = prompt_scores(self.engine)
        started = [r for r in self._unstarted if self.engine.request_started(str(r))]
        self._unstarted.difference_update(started)
        if self.trace_hops:
            for rid in started:
                hop_trace.mark("core_started", rid, self._step_entered)
        return m.StepOutput(rids, token_ids, logprobs, tops if any_top else None, finished,
                            started, self._state(), prompt, cached)

    def _state(self) -> m.EngineState:
        state = self._snapshot()
        self._last_state = state
        now = time.monotonic()
        if now - self._warm_at >= WARM_EVERY_S:
            state.warm_adapters, self._warm_at = self.engine.warm_adapters(), now
        return state

    def _state_changed(self) -> bool:
        now = self._snapshot()
        stale = time.monotonic() - self._warm_at >= WARM_EVERY_S
        return stale or now != self._last_state

    def _snapshot(self) -> m.EngineState:
        stats, pacer = self.engine.stats, self.engine.loop.pacer
        # vars(): a shallow view of the snapshot (asdict would deep-copy its lists every step).
        state = m.EngineState(**vars(self.engine.state_snapshot()),
                              prefix_cache_queries=stats.prefix_cache_queries,
                              prefix_cache_hits=stats.prefix_cache_hits)
        if pacer is not None:
            state.admission_waits, state.admission_wait_s = pacer.waits, pacer.waited_s
            state.admission_taken, state.admission_paced_steps = pacer.taken, pacer.paced_steps
            state.admission_gpu_idle_s = pacer.idle_s
        return state


def prompt_scores(engine: object) -> list[m.PromptScores]:
    """The prompt logprobs the engine's last step scored (engines without them: none)."""
    take = getattr(engine, "take_prompt_logprobs", None)
    if take is None:
        return []
    return [m.PromptScores(int(rid), start, [p.token_id for p in ps], [p.logprob for p in ps],
                           [list(p.top_logprobs) for p in ps])
            for rid, (start, ps) in take().items()]


# The status code of each way the engine ends a request with an error (others: INTERNAL).
CODE_OF_KIND = {ADAPTER_UNLOADABLE: "FAILED_PRECONDITION", DEADLINE: "DEADLINE_EXCEEDED",
                GRAMMAR_ERROR: "INVALID_ARGUMENT"}


def finish_of(rid: int, out: RequestOutput) -> m.Finish:
    """How a finished request's end reaches the front, with the status code of an error."""
    reason = out.finish_reason or "stop"
    if not out.error:
        return m.Finish(rid, reason)
    code = CODE_OF_KIND.get(out.error_kind, "INTERNAL")
    # An adapter that cannot be loaded is the version's fault: the gateway tries its fallback.
    return m.Finish(rid, reason, out.error, code, adapter_error=out.error_kind == ADAPTER_UNLOADABLE,
                    kind=out.error_kind)


class Commands:
    """Adapter commands from the front. Parsing an adapter's files runs on a thread of this
    process (the host tier has its own lock), so a load overlaps engine steps."""

    def __init__(self, engine: AnyEngine) -> None:
        self.engine = engine
        self._pool = concurrent.futures.ThreadPoolExecutor(2, thread_name_prefix="adapter-load")
        self._done: queue.SimpleQueue[m.CallResult] = queue.SimpleQueue()
        self._background: set[int] = set()
        self.pending = 0  # background commands not yet answered

    def start(self, call: m.Call) -> None:
        fn = getattr(self, f"do_{call.method}", None)
        if fn is None:
            self._done.put(m.CallResult(call.cid, error=f"unknown command {call.method!r}",
                                        code="INTERNAL"))
            return
        if call.method not in BACKGROUND:
            self._done.put(self._call(call.cid, fn, call.args))
            return
        self.pending += 1
        self._background.add(call.cid)
        self._pool.submit(lambda: self._done.put(self._call(call.cid, fn, call.args)))

    def done(self) -> list[m.CallResult]:
        """Results ready to send (background ones included)."""
        results = []
        while not self._done.empty():
            result = self._done.get_nowait()
            if result.cid in self._background:
                self._background.discard(result.cid)
                self.pending -= 1
            results.append(result)
        return results

    def _call(self, cid: int, fn: Any, args: list[Any]) -> m.CallResult:
        try:
            return m.CallResult(cid, value=fn(*args))
        except Exception as exc:
            err = to_service_error(exc)
            return m.CallResult(cid, error=str(err), code=err.code.name,
                                adapter_error=err.adapter_error)

    # ---- the commands (run on the loop thread unless listed as background above) --------
    def do_register_adapter(self, name: str, path: str, sha256: str) -> None:
        self.engine.register_adapter(name, path, sha256 or None, preload=False)

    def do_load_adapter(self, name: str) -> None:
        """Background: parse and validate into host memory; a bad adapter is unregistered."""
        try:
            self.engine.load_adapter(name)
        except Exception:
            self.engine.unregister_adapter(name)
            raise

    def do_unregister_adapter(self, name: str) -> None:
        self.engine.unregister_adapter(name)

    def do_release_adapter(self, name: str, path: str, sha256: str) -> None:
        """Drop the host copy but keep the registration (a later request reloads from disk)."""
        self.engine.unregister_adapter(name)
        self.engine.register_adapter(name, path, sha256 or None, preload=False)

    def do_warm_adapters(self) -> list[str]:
        return self.engine.warm_adapters()

    def do_touch_adapters(self, names: list[str]) -> None:
        """Background: keep pinned versions in the host LRU."""
        for name in names:
            self.engine.load_adapter(name)
