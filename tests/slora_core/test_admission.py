"""Late admission (slora_core/admission.py, EngineConfig.admission_lead_ms): the pacer's
estimate of how long the serving loop may take requests before the next step must launch,
and the engine core's loop taking the requests that arrive in that window."""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Any

import pytest
import torch
import zmq

from services.worker import core_protocol as m
from services.worker.engine_core import EngineCore
from slora_core.admission import (
    EWMA,
    GAP_MAX_S,
    GAP_NOISE_S,
    PROBE_S,
    AdmissionPacer,
    size_class,
)
from slora_core.config import ConfigError, EngineConfig
from slora_core.sampling_params import SamplingParams


def test_the_wait_runs_to_the_steps_end_less_launch_and_lead() -> None:
    pacer = AdmissionPacer(lead_s=0.001)
    assert pacer.wait_s(now=0.0) == 0.0  # nothing measured
    pacer.step_done(0.010, tokens=64)
    pacer.launched(0.002, tokens=64)
    assert pacer.wait_s(now=0.0) == 0.0  # no step read yet: none known to be running
    pacer.read(at=100.0, running=True)
    # The step under way started at 100.0 and ends at 100.010; the next must launch 2 ms
    # (host) + 1 ms (lead) before: 7 ms from the read, 4 ms from 100.003.
    assert pacer.wait_s(now=100.0) == pytest.approx(0.007)
    assert pacer.wait_s(now=100.003) == pytest.approx(0.004)
    assert pacer.wait_s(now=100.008) == 0.0  # past it: launch at once
    pacer.read(at=200.0, running=False)  # nothing launched: nothing to wait for
    assert pacer.wait_s(now=200.0) == 0.0


def test_steps_of_another_size_keep_their_own_estimate() -> None:
    """A long prefill step does not lengthen the wait before a decode step, and a step of a
    size never timed gets no wait."""
    pacer = AdmissionPacer(lead_s=0.0)
    pacer.step_done(0.010, tokens=64)   # decode steps
    pacer.step_done(0.100, tokens=3700)  # a mixed step
    pacer.step_done(0.030, tokens=40)   # 32-63 tokens: the same class as 63, not 64
    assert size_class(63) == size_class(40) != size_class(64) == size_class(127)
    pacer.launched(0.0, tokens=64)
    pacer.read(at=0.0, running=True)
    assert pacer.wait_s(now=0.0) == pytest.approx(0.010)
    pacer.launched(0.0, tokens=3000)
    pacer.read(at=0.0, running=True)
    assert pacer.wait_s(now=0.0) == pytest.approx(0.100)
    pacer.launched(0.0, tokens=300)  # never timed
    pacer.read(at=0.0, running=True)
    assert pacer.wait_s(now=0.0) == 0.0


def test_the_estimates_follow_the_steps_and_the_wait_stays_under_one_step() -> None:
    pacer = AdmissionPacer(lead_s=0.0)
    pacer.step_done(0.010, tokens=64)
    pacer.step_done(0.030, tokens=64)  # a longer step moves the estimate by EWMA of it
    assert pacer.gpu_step_s[size_class(64)] == pytest.approx(0.010 + EWMA * 0.020)
    pacer.launched(0.0, tokens=64)
    pacer.read(at=0.0, running=True)
    # A clock read before the step started never waits more than one step's GPU time.
    assert pacer.wait_s(now=-1.0) == pytest.approx(pacer.gpu_step_s[size_class(64)])


def test_an_idle_gpu_before_a_paced_step_shortens_later_waits_until_probed_back() -> None:
    """The GPU's idle gap before a paced step (its wait overran the step under way) comes off
    every later wait; each launch takes PROBE_S back; a gap within the events' noise is no
    idle; a step launched with no wait before it is not paced."""
    pacer = AdmissionPacer(lead_s=0.0)
    pacer.step_done(0.010, tokens=64)
    assert pacer.launched(0.0, tokens=64) is False  # no wait was given before it
    pacer.read(at=0.0, running=True)
    assert pacer.wait_s(now=0.0) == pytest.approx(0.010)
    assert pacer.launched(0.0, tokens=64) is True  # that wait paced it
    pacer.idle(0.0003)  # and the GPU idled 0.3 ms before it started
    assert (pacer.paced_steps, pacer.idle_s, pacer.slack_s) == (1, 0.0003, 0.0003)
    pacer.read(at=0.0, running=True)
    assert pacer.wait_s(now=0.0) == pytest.approx(0.0097)
    assert pacer.launched(0.0, tokens=64) is True
    pacer.idle(GAP_NOISE_S / 2)  # no idle: the slack only loses the launch's probe
    assert pacer.slack_s == pytest.approx(0.0003 - PROBE_S) and pacer.paced_steps == 2
    pacer.launched(0.0, tokens=64)
    pacer.idle(0.005)  # a lone 5 ms hiccup adds GAP_MAX_S at most
    assert pacer.slack_s == pytest.approx(0.0003 - 2 * PROBE_S + GAP_MAX_S)
    assert "3 paced steps, GPU idle before them 5.3 ms in all (1767 us a step)" in (
        pacer.summary())
    pacer.took(0.004, requests=3)  # the serving loop's waits and what they took
    pacer.took(0.0025, requests=0)
    assert pacer.summary().endswith("; 2 waits, 6.5 ms in all, took 3 requests")
    for _ in range(40):  # unpaced launches probe it back to none, never below
        pacer.launched(0.0, tokens=64)
    assert pacer.slack_s == 0.0
    pacer.read(at=0.0, running=True)
    assert pacer.wait_s(now=0.0) == pytest.approx(0.010)


def test_a_negative_or_nan_lead_is_refused() -> None:
    for bad in (-1.0, float("nan")):
        with pytest.raises(ConfigError, match="admission_lead_ms"):
            EngineConfig(admission_lead_ms=bad)
    assert EngineConfig().admission_lead_ms == 1.0  # on by default (slora_core/config.py)


class WaitingEngine:
    """What EngineCore's late admission uses of an engine (its loop's wait; the engine stands
    for its loop here), and the aborts a test sends as the messages to drain."""

    def __init__(self, wait_s: float, pacer: AdmissionPacer | None = None) -> None:
        self.wait_s = wait_s
        self.pacer = pacer  # counts the waits and what they took
        self.aborted: list[tuple[str, float]] = []
        self.added: list[str] = []

    @property
    def loop(self) -> WaitingEngine:
        return self

    def admission_wait_s(self) -> float:
        return self.wait_s

    def abort_request(self, rid: str) -> Any:
        self.aborted.append((rid, time.monotonic()))

    def add_request(self, rid: str, *args: Any, **kwargs: Any) -> None:
        self.added.append(rid)


@pytest.fixture
def sockets() -> Any:
    ctx = zmq.Context()
    pull, push = ctx.socket(zmq.PULL), ctx.socket(zmq.PUSH)
    pull.bind("inproc://admission")
    push.connect("inproc://admission")
    yield push, pull
    push.close(linger=0)
    pull.close(linger=0)
    ctx.term()


def send_later(push: zmq.Socket, msg: Any, after_s: float) -> threading.Thread:
    def run() -> None:
        time.sleep(after_s)
        push.send(m.encoder.encode(msg))

    thread = threading.Thread(target=run)
    thread.start()
    return thread


def test_the_core_takes_requests_that_arrive_within_the_wait(sockets: Any) -> None:
    push, pull = sockets
    engine = WaitingEngine(wait_s=0.3)
    core = EngineCore(engine, outputs=None, parent_pid=0)  # type: ignore[arg-type]
    began = time.monotonic()
    thread = send_later(push, m.Abort([7]), after_s=0.05)
    assert core._admit_late(pull)
    thread.join()
    took = time.monotonic() - began
    assert [rid for rid, _ in engine.aborted] == ["7"]  # drained inside the window
    assert 0.29 <= took < 1.0  # it waited the window out, not just until the first message


def test_the_pacer_counts_the_waits_and_the_requests_they_took(sockets: Any) -> None:
    push, pull = sockets
    pacer = AdmissionPacer(lead_s=0.001)
    engine = WaitingEngine(wait_s=0.2, pacer=pacer)
    core = EngineCore(engine, outputs=None, parent_pid=0)  # type: ignore[arg-type]
    sampling = m.SamplingMsg.of(SamplingParams(max_new_tokens=3))
    thread = send_later(push, m.AddRequest(5, [1, 2, 3], sampling), after_s=0.05)
    assert core._admit_late(pull)
    thread.join()
    assert engine.added == ["5"] and (pacer.waits, pacer.taken) == (1, 1)
    assert 0.19 <= pacer.waited_s < 1.0
    engine.wait_s = 0.0  # no wait: nothing counted
    assert core._admit_late(pull) and pacer.waits == 1


def test_the_wait_runs_to_its_end_below_a_millisecond(sockets: Any) -> None:
    # zmq polls whole milliseconds; the pacer's waits are not whole milliseconds.
    _, pull = sockets
    for wait_s in (0.0025, 0.0004):
        engine = WaitingEngine(wait_s=wait_s)
        core = EngineCore(engine, outputs=None, parent_pid=0)  # type: ignore[arg-type]
        began = time.monotonic()
        assert core._admit_late(pull)
        assert time.monotonic() - began >= wait_s


def test_without_a_wait_the_core_goes_straight_to_the_next_step(sockets: Any) -> None:
    push, pull = sockets
    engine = WaitingEngine(wait_s=0.0)
    core = EngineCore(engine, outputs=None, parent_pid=0)  # type: ignore[arg-type]
    push.send(m.encoder.encode(m.Abort([3])))
    time.sleep(0.05)
    began = time.monotonic()
    assert core._admit_late(pull)
    assert time.monotonic() - began < 0.05 and engine.aborted == []  # left for the loop


def test_a_shutdown_inside_the_wait_ends_it(sockets: Any) -> None:
    push, pull = sockets
    engine = WaitingEngine(wait_s=5.0)
    core = EngineCore(engine, outputs=None, parent_pid=0)  # type: ignore[arg-type]
    thread = send_later(push, m.Shutdown(), after_s=0.05)
    began = time.monotonic()
    assert not core._admit_late(pull)
    thread.join()
    assert time.monotonic() - began < 2.0


def test_the_pacer_runs_only_with_asynchronous_steps_on_cuda(demo_dir: Path) -> None:
    """On the CPU (nothing runs beside the host) late admission stays off, asked or not."""
    from slora_core.engine import LLMEngine

    engine = LLMEngine.from_model_dir(demo_dir / "model", EngineConfig(
        num_pages=64, block_size=16, max_rank=16, async_steps=True, admission_lead_ms=1.0))
    assert engine.loop.pacer is None and engine.loop.admission_wait_s() == 0.0


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_on_the_gpu_the_pacer_times_the_steps_and_changes_no_token(demo_dir: Path) -> None:
    """With late admission the engine measures its steps' GPU and launch times and offers a
    wait within one step; the tokens are those of an engine without it."""
    from slora_core.engine import LLMEngine
    from slora_core.sampling_params import SamplingParams

    def tokens(lead_ms: float) -> tuple[dict[str, list[int]], Any]:
        engine = LLMEngine.from_model_dir(demo_dir / "model", EngineConfig(
            num_pages=64, block_size=16, max_rank=16, device="cuda",
            admission_lead_ms=lead_ms))
        params = SamplingParams(max_new_tokens=12, temperature=0.0)
        for i in range(4):
            engine.add_request(str(i), [1, 5 + i, 9, 13], params)
        out: dict[str, list[int]] = {}
        waits = []
        late_reads: list[float] = []  # read times stamped after the tokens were streamed
        complete = engine.loop._complete

        def streamed(inflight: Any) -> Any:
            began = time.monotonic()
            outs = complete(inflight)
            pacer = engine.loop.pacer
            if pacer is not None and pacer.read_at is not None and pacer.read_at > began:
                late_reads.append(pacer.read_at - began)
            return outs

        engine.loop._complete = streamed  # type: ignore[method-assign]
        while engine.has_unfinished():
            for o in engine.step():
                out.setdefault(o.request_id, []).extend(o.token_ids)
            waits.append(engine.loop.admission_wait_s())
        pacer = engine.loop.pacer
        engine.close()
        assert late_reads == []  # the read is when the tokens land, before they stream
        return out, (pacer, waits)

    plain, (none, _) = tokens(0.0)
    paced, (pacer, waits) = tokens(0.5)
    assert none is None and pacer is not None
    assert paced == plain and all(len(t) == 12 for t in paced.values())
    assert pacer.gpu_step_s and min(pacer.gpu_step_s.values()) > 0.0
    assert pacer.host_launch_s > 0.0
    assert all(0.0 <= w <= max(pacer.gpu_step_s.values()) for w in waits)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_on_the_gpu_a_paced_step_after_an_overrun_reports_the_idle_gap(demo_dir: Path) -> None:
    """A serving loop that sleeps 3 ms past each step's return (every step taken as paced)
    leaves the GPU idle about that long before each next step: the pacer reads it from the
    CUDA events and carries it (GAP_MAX_S of each) as slack."""
    from slora_core.engine import LLMEngine
    from slora_core.sampling_params import SamplingParams

    engine = LLMEngine.from_model_dir(demo_dir / "model", EngineConfig(
        num_pages=64, block_size=16, max_rank=16, device="cuda", admission_lead_ms=0.5))
    pacer = engine.loop.pacer
    assert pacer is not None
    for i in range(4):
        engine.add_request(str(i), [1, 5 + i, 9, 13], SamplingParams(max_new_tokens=12))
    while engine.has_unfinished():
        pacer.waited = True  # as if a wait had come before this step
        engine.step()
        time.sleep(0.003)
    engine.close()
    assert pacer.paced_steps >= 8
    assert pacer.idle_s / pacer.paced_steps > 0.002
    assert pacer.slack_s > 0.002
