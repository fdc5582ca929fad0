"""When the engine core launches its next step (asynchronous steps): at once, or as late as the
step in flight allows, so that requests arriving meanwhile join it.

With asynchronous steps the core launches step k+2 as soon as it has read step k's tokens,
while the device still runs k+1. A request that arrives a few milliseconds after k's tokens
went out (a client's next request after the round trip through the front and the gateway)
misses k+2 and waits for k+3: a whole step more than if it had come at once. On an H100 at
64 streams, closed loop, the hop trace's `worker_added -> core_added` read 9.6 ms p50, one
decode step (docs/performance.md, "The core launches a step late enough to take arrivals").

`LaunchWait` holds the launch until the longest of the last HISTORY launches' host time
(`StepLoop.launch_s`) plus `margin_s` before the step in flight should end, taking every
request that arrives meanwhile, and launches at once when the device has finished it (then the
device waits a launch, as with synchronous steps). The step's end is estimated from the
shortest of the last HISTORY intervals between step returns: while the device is the
bottleneck each one is a step's device time.

A measuring switch (env SLORA_LAUNCH_WAIT_MS=margin), off by default until a run side by side
shows what it does to TTFT and throughput.
"""

from __future__ import annotations

import itertools
import logging
import os
from collections import deque
from collections.abc import Mapping

from services.worker.debug_hooks import env_number

log = logging.getLogger(__name__)
LAUNCH_WAIT_ENV = "SLORA_LAUNCH_WAIT_MS"
HISTORY = 4  # step intervals the estimate takes the shortest of


class LaunchWait:
    def __init__(self, margin_s: float) -> None:
        if margin_s < 0:
            raise ValueError(f"the launch margin must be 0 or more, got {margin_s}")
        self.margin_s = margin_s
        self._returns: deque[float] = deque(maxlen=HISTORY + 1)
        self._launches: deque[float] = deque(maxlen=HISTORY)

    def stepped(self, at: float, launch_s: float) -> None:
        """A step returned at `at` (time.monotonic()) after `launch_s` host seconds launching
        its batch."""
        self._returns.append(at)
        self._launches.append(launch_s)

    def idle(self) -> None:
        """The engine ran out of work: the next intervals are measured afresh."""
        self._returns.clear()
        self._launches.clear()

    def deadline(self) -> float | None:
        """The latest time.monotonic() to start the next step at; None before two intervals
        are known."""
        if len(self._returns) < 3:
            return None
        shortest = min(b - a for a, b in itertools.pairwise(self._returns))
        return self._returns[-1] + shortest - max(self._launches) - self.margin_s


def launch_margin_from_env(env: Mapping[str, str] = os.environ) -> float | None:
    """The switch, read by the worker front (its core gets it in CoreSpec):
    SLORA_LAUNCH_WAIT_MS=MARGIN, milliseconds before the estimated end of the step in flight;
    returns it in seconds, or None when unset (launch at once). ValueError when malformed or
    outside [0, 50]."""
    margin_ms = env_number(env, LAUNCH_WAIT_ENV, 50.0, "milliseconds")
    if margin_ms is None:
        return None
    log.info("%s=%g: steps launch up to %g ms before the step in flight should end",
             LAUNCH_WAIT_ENV, margin_ms, margin_ms)
    return margin_ms / 1e3
