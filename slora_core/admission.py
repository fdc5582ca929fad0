"""Late admission for asynchronous steps.

With asynchronous steps `step()` schedules and launches step k, then reads step k-1's tokens
and returns: the GPU runs step k from then on, and the next `step()` schedules step k+1 at
once. A request that arrives a moment after that (a closed-loop client's next request, which
comes the hops after its predecessor's last token) waits until step k+2 is scheduled: a
whole step later than one added before `step()` returned (docs/performance.md, "the late
arrival"). With `EngineConfig.admission_lead_ms` set, the serving loop may keep taking new
requests after a step returns, until the step under way on the GPU is about to end less the
host's time to schedule and launch the next one and that lead: the next step still starts
as the GPU frees, and requests that came meanwhile join it.

`AdmissionPacer` keeps the estimates: the GPU time of a step of about as many tokens
(CUDA events around each step's launches, read once its tokens are read; steps are told
apart by their token count's power of two, so that a long prefill step does not lengthen
the wait before a decode step), the host's time from entering `step()` to its launch, and
when the last read returned (the step after it started on the GPU then).

The estimates can still miss what the host does between a read and the next launch
(streaming the outputs, the front's messages), and a wait that overruns idles the GPU. So
the pacer also takes the GPU's own word: the idle gap between a paced step's predecessor's
end and its start (CUDA events on the same stream). An idle gap (up to `GAP_MAX_S` of it)
adds to `slack_s`, which shortens every later wait by as much; every launch takes `PROBE_S`
off it, so the wait creeps back towards the step's end while the GPU stays busy (and comes
back after a run of steps the slack left unpaced)."""

from __future__ import annotations

from dataclasses import dataclass, field

# Weight of the newest sample in the running estimates.
EWMA = 0.25
# How the pacer's log line (`AdmissionPacer.summary`) begins: bench.service_overhead finds
# the worker's lines by it.
SUMMARY_PREFIX = "late admission (lead"
# What each launch takes off the slack (s).
PROBE_S = 25e-6
# An idle gap shorter than this between two steps' events is the events' own cost, not idle.
GAP_NOISE_S = 20e-6
# The most one gap adds to the slack: a lone hiccup (a collection, a slow message) must not
# turn pacing off for hundreds of steps (a run's tail left 9.6 ms of slack at 20a18b8 with no
# cap); an overrun that repeats still adds up within a few steps.
GAP_MAX_S = 0.5e-3


def size_class(tokens: int) -> int:
    """Steps of 2^(c-1) to 2^c - 1 tokens share class c."""
    return tokens.bit_length()


@dataclass
class AdmissionPacer:
    """When the serving loop must call `step()` again so the GPU does not idle, less
    `lead_s`; 0 while nothing is measured yet or no step is under way."""

    lead_s: float
    gpu_step_s: dict[int, float] = field(default_factory=dict)  # by size_class
    host_launch_s: float = 0.0  # step() entry to its launch (running estimate)
    read_at: float | None = None  # when the last step's tokens were read (monotonic s)
    running: int | None = None    # the size class of the step launched last
    slack_s: float = 0.0  # taken off every wait: the GPU idled that long before
    waited: bool = False  # wait_s gave a wait since the last launch
    paced_steps: int = 0  # steps launched after a wait, and their GPU idle gaps in all (s)
    idle_s: float = 0.0
    waits: int = 0  # the serving loop's waits, their time in all (s), the requests they took
    waited_s: float = 0.0
    taken: int = 0

    def launched(self, host_s: float, tokens: int) -> bool:
        """A step of `tokens` was launched `host_s` after step() was entered; True when it
        was paced (a wait came before it)."""
        self.host_launch_s = _mix(self.host_launch_s, host_s)
        self.running = size_class(tokens)
        self.slack_s = max(0.0, self.slack_s - PROBE_S)
        paced, self.waited = self.waited, False
        return paced

    def idle(self, gap_s: float) -> None:
        """The GPU idled `gap_s` before a paced step started."""
        self.paced_steps += 1
        if gap_s > GAP_NOISE_S:
            self.idle_s += gap_s
            self.slack_s += min(gap_s, GAP_MAX_S)

    def took(self, waited_s: float, requests: int) -> None:
        """The serving loop waited `waited_s` before calling step() and took `requests` new
        requests meanwhile (each joins the next step instead of the one after it)."""
        self.waits += 1
        self.waited_s += waited_s
        self.taken += requests

    def summary(self) -> str:
        """One line for the log: what pacing cost the GPU so far."""
        per = self.idle_s / self.paced_steps * 1e6 if self.paced_steps else 0.0
        return (f"{SUMMARY_PREFIX} {self.lead_s * 1e3:g} ms): {self.paced_steps} paced "
                f"steps, GPU idle before them {self.idle_s * 1e3:.1f} ms in all ({per:.0f} us "
                f"a step), slack now {self.slack_s * 1e6:.0f} us, host launch "
                f"{self.host_launch_s * 1e6:.0f} us; {self.waits} waits, "
                f"{self.waited_s * 1e3:.1f} ms in all, took {self.taken} requests")

    def trace_key(self, now: float) -> str:
        """Hop traces' `loop_wait` key: what a wait was made of, in us (the step under way's
        size class and estimate, the host's launch, the slack, the time since the read)."""
        step = self.gpu_step_s.get(self.running, 0.0) if self.running is not None else 0.0
        since = now - self.read_at if self.read_at is not None else -1.0
        return (f"class={self.running},step={step * 1e6:.0f},host={self.host_launch_s * 1e6:.0f},"
                f"slack={self.slack_s * 1e6:.0f},since_read={since * 1e6:.0f}")

    def step_done(self, gpu_s: float, tokens: int) -> None:
        c = size_class(tokens)
        self.gpu_step_s[c] = _mix(self.gpu_step_s.get(c, 0.0), gpu_s)

    def read(self, at: float, running: bool) -> None:
        """A step's tokens were read at `at`; `running`: the step launched last is on the
        GPU."""
        self.read_at = at if running else None

    def wait_s(self, now: float) -> float:
        """How long the loop may still take requests before calling `step()`: until the step
        under way ends (it began when the step before was read; as long as steps of its size
        took) less the host's launch time, the lead and the slack; never more than that step's
        time."""
        step = self.gpu_step_s.get(self.running, 0.0) if self.running is not None else 0.0
        if self.read_at is None or step <= 0.0:
            return 0.0
        end = self.read_at + step
        wait = max(0.0, min(step, end - self.host_launch_s - self.lead_s - self.slack_s - now))
        self.waited = self.waited or wait > 0.0
        return wait


def _mix(old: float, new: float) -> float:
    return new if old <= 0.0 else old + EWMA * (new - old)
