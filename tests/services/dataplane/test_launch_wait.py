"""The engine core's launch wait (services/worker/launch_wait.py): with asynchronous steps the
next step's launch is held until shortly before the step in flight should end, so requests
arriving meanwhile join it; it launches at once when the device is done, when the batch has
no room, or before two step intervals are known."""

from __future__ import annotations

import threading
import time
from typing import Any

import pytest
import zmq

from services.worker import core_protocol as m
from services.worker.core_client import sampling_msg
from services.worker.engine_core import EngineCore
from services.worker.launch_wait import LAUNCH_WAIT_ENV, LaunchWait, launch_margin_from_env
from slora_core.sampling_params import SamplingParams


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

    def in_flight_done(self) -> bool | None:
        return time.monotonic() >= self.done_at

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
    engine.in_flight_done = lambda: None  # type: ignore[method-assign]
    held, _ = hold(engine, 0.3, None)
    assert held < 0.05
