"""The engine core's launch wait (services/worker/launch_wait.py): with asynchronous steps the
next step's launch is held until shortly before the step in flight should end, so requests
arriving meanwhile join it; it launches at once when the device is done, when the batch has
no room, or before two step intervals are known."""

from __future__ import annotations

import itertools
import os
import statistics
import threading
import time
from types import SimpleNamespace
from typing import Any

import pytest
import zmq

from services.worker import core_protocol as m
from services.worker.core_client import sampling_msg
from services.worker.engine_core import EngineCore
from services.worker.launch_wait import LAUNCH_WAIT_ENV, LaunchWait, launch_margin_from_env
from slora_core.outputs import RequestOutput, TokenLogprob
from slora_core.sampling_params import SamplingParams
from slora_core.stats import EngineSnapshot


def test_the_deadline_leaves_the_longest_launch_and_the_margin_before_the_step_ends() -> None:
    """The step in flight ends the shortest recent interval after the last return; the next
    launch must start the longest recent launch's host time plus the margin before that."""
    wait = LaunchWait(0.002)
    assert wait.deadline() is None
    wait.stepped(1.000, 0.001)
    wait.stepped(1.010, 0.003)
    assert wait.deadline() is None  # one interval is not enough
    wait.stepped(1.030, 0.001)
    assert wait.deadline() == pytest.approx(1.030 + 0.010 - 0.003 - 0.002)
    for at in (1.050, 1.070, 1.090, 1.110):  # the 10 ms interval and 3 ms launch fall out
        wait.stepped(at, 0.001)
    assert wait.deadline() == pytest.approx(1.110 + 0.020 - 0.001 - 0.002)
    wait.idle()
    assert wait.deadline() is None


@pytest.mark.parametrize("raw, margin", [("", None), ("  ", None), ("2", 0.002),
                                         ("0.5", 0.0005), ("0", 0.0)])
def test_the_switch_reads_its_margin_in_milliseconds(raw: str, margin: float | None) -> None:
    got = launch_margin_from_env({LAUNCH_WAIT_ENV: raw})
    assert got == (None if margin is None else pytest.approx(margin))


@pytest.mark.parametrize("raw", ["soon", "-1", "51"])
def test_a_bad_switch_is_refused_with_its_name(raw: str) -> None:
    with pytest.raises(ValueError, match=LAUNCH_WAIT_ENV):
        launch_margin_from_env({LAUNCH_WAIT_ENV: raw})


class FakeEngine:
    """What _hold_launch and _drain use: a step in flight until `done_at`."""

    def __init__(self, done_at: float) -> None:
        self.done_at = done_at
        self.added: list[tuple[str, float]] = []
        self.loop = SimpleNamespace(inflight_ready=lambda: time.monotonic() >= self.done_at)

    def add_request(self, rid: str, *args: Any, **kwargs: Any) -> None:
        self.added.append((rid, time.monotonic()))


def hold(engine: FakeEngine, deadline_in_s: float, arrive_in_s: float | None,
         state: m.EngineState | None = None) -> tuple[float, list[tuple[str, float]]]:
    """Run one _hold_launch with a deadline `deadline_in_s` away and a request pushed after
    `arrive_in_s`; returns how long it held and what the engine was given meanwhile."""
    ctx = zmq.Context()
    pull, push = ctx.socket(zmq.PULL), ctx.socket(zmq.PUSH)
    pull.bind("inproc://core-in")
    push.connect("inproc://core-in")
    wait = LaunchWait(0.0)
    now = time.monotonic()
    for at in (now - 2 * deadline_in_s, now - deadline_in_s, now):  # intervals of deadline_in_s
        wait.stepped(at, 0.0)
    core = EngineCore(engine, outputs=None, parent_pid=0,  # type: ignore[arg-type]
                      launch_wait=wait, max_num_seqs=4)
    core._last_state = state
    msg = m.encoder.encode(m.AddRequest(7, [1, 2, 3], sampling_msg(SamplingParams())))
    sender = None
    if arrive_in_s is not None:
        sender = threading.Timer(arrive_in_s, lambda: push.send(msg))
        sender.start()
    try:
        t0 = time.monotonic()
        assert core._hold_launch(pull)
        held = time.monotonic() - t0
        if sender is not None:
            sender.join()
        return held, [(rid, at - t0) for rid, at in engine.added]
    finally:
        core.commands._pool.shutdown()
        pull.close(linger=0)
        push.close(linger=0)
        ctx.term()


def test_a_request_arriving_before_the_deadline_joins_the_next_launch() -> None:
    held, added = hold(FakeEngine(done_at=time.monotonic() + 10), 0.06, arrive_in_s=0.015)
    assert [rid for rid, _ in added] == ["7"]
    assert 0.01 <= added[0][1] < held  # taken as it came, before the launch
    assert 0.045 <= held <= 0.2


def test_the_launch_goes_at_once_when_the_device_has_finished_the_step() -> None:
    held, added = hold(FakeEngine(done_at=time.monotonic() + 0.01), 0.3, arrive_in_s=None)
    assert added == [] and held < 0.15


@pytest.mark.parametrize("state", [m.EngineState(running=3, waiting=1),
                                   m.EngineState(running=4)])
def test_a_full_batch_launches_at_once(state: m.EngineState) -> None:
    held, _ = hold(FakeEngine(done_at=time.monotonic() + 10), 0.3, None, state)
    assert held < 0.05


def test_no_step_in_flight_launches_at_once() -> None:
    engine = FakeEngine(done_at=0.0)
    engine.loop.inflight_ready = lambda: None
    held, _ = hold(engine, 0.3, None)
    assert held < 0.05


class SimulatedAsyncEngine:
    """An engine whose steps run on a simulated device, asynchronously as LLMEngine's do:
    step() launches a batch of every live request (STEP_S of device time, queued behind the
    batch in flight), then waits for the batch in flight and returns its tokens."""

    STEP_S = 0.06

    def __init__(self, tokens_per_request: int) -> None:
        self.tokens = tokens_per_request
        self.live: dict[str, int] = {}  # request id -> tokens still to come
        self.inflight: tuple[list[str], float] | None = None  # its requests, its device end
        self.loop = SimpleNamespace(inflight_ready=self.inflight_ready, launch_s=0.0005)
        self.stats = SimpleNamespace(prefix_cache_queries=0, prefix_cache_hits=0)

    def add_request(self, rid: str, *args: Any, **kwargs: Any) -> None:
        self.live[rid] = self.tokens

    def has_unfinished(self) -> bool:
        return bool(self.live) or self.inflight is not None

    def inflight_ready(self) -> bool | None:
        return None if self.inflight is None else time.monotonic() >= self.inflight[1]

    def step(self) -> list[RequestOutput]:
        inflight, self.inflight = self.inflight, None
        batch = [rid for rid, left in self.live.items() if left > 0]
        if batch:
            start = max(time.monotonic(), inflight[1] if inflight else 0.0)
            self.inflight = (batch, start + self.STEP_S)
            for rid in batch:
                self.live[rid] -= 1
        if inflight is None:
            return []
        time.sleep(max(0.0, inflight[1] - time.monotonic()))
        outs = []
        for rid in inflight[0]:
            done = self.live.get(rid) == 0 and (self.inflight is None or
                                                rid not in self.inflight[0])
            if done:
                del self.live[rid]
            outs.append(RequestOutput(rid, [1], logprobs=[TokenLogprob(1, 0.0)], finished=done,
                                      finish_reason="length" if done else None,
                                      completion_tokens=self.tokens - self.live.get(rid, 0)))
        return outs

    def abort_request(self, rid: str) -> None:
        self.live.pop(rid, None)

    def request_ids(self) -> list[str]:
        return list(self.live)

    def request_started(self, rid: str) -> bool:
        return True

    def warm_adapters(self) -> list[str]:
        return []

    def keepalive(self) -> None:
        pass

    def state_snapshot(self) -> EngineSnapshot:
        return EngineSnapshot(len(self.live), 0, 0, 0, 0, 0, 0, 0, [], [])


def closed_loop_ttft(wait: LaunchWait | None, streams: int = 4, per_stream: int = 4,
                     hop_s: float = 0.01) -> tuple[list[float], float]:
    """The real EngineCore loop over the simulated engine, fed by a closed loop whose next
    request reaches the core `hop_s` after the previous one's end went out (the round trip
    through the front and the gateway): each request's time from its arrival to its first
    token's output, and the seconds the whole loop took."""
    ctx = zmq.Context()
    core_in, client_out = ctx.socket(zmq.PULL), ctx.socket(zmq.PUSH)
    core_out, client_in = ctx.socket(zmq.PUSH), ctx.socket(zmq.PULL)
    core_in.bind("inproc://sim-in")
    client_out.connect("inproc://sim-in")
    client_in.bind("inproc://sim-out")
    core_out.connect("inproc://sim-out")
    core = EngineCore(SimulatedAsyncEngine(tokens_per_request=3), core_out,  # type: ignore[arg-type]
                      parent_pid=os.getppid(), launch_wait=wait, max_num_seqs=64)
    loop = threading.Thread(target=core.run, args=(core_in,), daemon=True)
    loop.start()
    sent: dict[int, float] = {}
    ttft: list[float] = []
    ids = itertools.count(1)

    def send() -> None:
        rid = next(ids)
        sent[rid] = time.monotonic()
        client_out.send(m.encoder.encode(m.AddRequest(rid, [1, 2], sampling_msg(
            SamplingParams()))))

    try:
        t0 = time.monotonic()
        for _ in range(streams):
            send()
        left = streams * per_stream - streams
        seen: set[int] = set()
        ended = 0
        while ended < streams * per_stream:
            out = m.from_core_decoder.decode(client_in.recv())
            assert isinstance(out, m.StepOutput)
            now = time.monotonic()
            for rid in out.rids:
                if rid not in seen:
                    seen.add(rid)
                    ttft.append(now - sent[rid])
            for _ in out.finished:
                ended += 1
                if left:
                    left -= 1
                    threading.Timer(hop_s, send).start()
        wall = time.monotonic() - t0
        client_out.send(m.encoder.encode(m.Shutdown()))
        loop.join(5)
        assert not loop.is_alive()
        return ttft, wall
    finally:
        core.commands._pool.shutdown()
        for sock in (core_in, client_out, core_out, client_in):
            sock.close(linger=0)
        ctx.term()


@pytest.mark.slow  # wall-clock timing: a machine starved of CPU (2 cores, 4 busy) can fail it
def test_held_launches_take_a_closed_loop_s_next_requests_a_step_sooner() -> None:
    """A request reaching the core a few ms after the previous one's end joins the step
    launched next when the launch waits, and the one after it when it does not (one step
    sooner: 84.6 against 54.5 ms at the median with 30 ms steps on the 2-core machine), and
    the loop takes no longer for it (0.51 against 0.55 s there)."""
    step = SimulatedAsyncEngine.STEP_S
    at_once, at_once_wall = closed_loop_ttft(None)
    held, held_wall = closed_loop_ttft(LaunchWait(0.008))
    assert statistics.median(at_once) - statistics.median(held) >= 0.5 * step, (at_once, held)
    assert held_wall < at_once_wall + 0.5 * step, (held_wall, at_once_wall)
