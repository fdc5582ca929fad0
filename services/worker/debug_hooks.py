"""Test hooks, off unless their environment variable is set.

`SLORA_DEBUG_SLOW_VERSIONS="ADAPTER@VERSION=SECONDS[,...]"` makes the worker sleep SECONDS
before every chunk it streams for those versions: a slow canary on demand, so tests (and
operators trying a policy) can watch the analyzer roll it back on latency.

`SLORA_DEBUG_STEP_DELAY_S=SECONDS` makes the engine core sleep SECONDS after every step: a slow
engine on demand, so a test can hold a worker full (one request running, one waiting) for as
long as it needs to look at it, however fast the machine runs the tiny demo model.

Never set them in production; the worker logs a warning at start-up when one is set.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping

from services.common.versions import VersionKey

log = logging.getLogger(__name__)
SLOW_VERSIONS_ENV = "SLORA_DEBUG_SLOW_VERSIONS"
STEP_DELAY_ENV = "SLORA_DEBUG_STEP_DELAY_S"


def parse_slow_versions(spec: str) -> dict[VersionKey, float]:
    """`"a@v2=0.2,b@v1=1"` -> {("a", "v2"): 0.2, ("b", "v1"): 1.0}; ValueError when malformed."""
    delays: dict[VersionKey, float] = {}
    for item in filter(None, (part.strip() for part in spec.split(","))):
        name, sep, seconds = item.partition("=")
        adapter_id, at, version = name.rpartition("@")
        if not sep or not at or not adapter_id or not version:
            raise ValueError(f"{SLOW_VERSIONS_ENV}: {item!r} is not ADAPTER@VERSION=SECONDS")
        delay = float(seconds)
        if not 0.0 <= delay <= 60.0:
            raise ValueError(f"{SLOW_VERSIONS_ENV}: delay {delay} outside [0, 60] seconds")
        delays[(adapter_id, version)] = delay
    return delays


def slow_versions_from_env(env: Mapping[str, str] = os.environ) -> dict[VersionKey, float]:
    delays = parse_slow_versions(env.get(SLOW_VERSIONS_ENV, ""))
    if delays:
        log.warning("%s is set: chunks of %s are delayed on purpose (a test hook)",
                    SLOW_VERSIONS_ENV, ", ".join(f"{a}@{v}={d}s" for (a, v), d in delays.items()))
    return delays


def step_delay_from_env(env: Mapping[str, str] = os.environ) -> float:
    """Seconds the engine core sleeps after each step (0: the hook is off); ValueError when
    malformed or outside [0, 10]."""
    raw = env.get(STEP_DELAY_ENV, "").strip()
    if not raw:
        return 0.0
    try:
        delay = float(raw)
    except ValueError:
        raise ValueError(f"{STEP_DELAY_ENV}: {raw!r} is not a number of seconds") from None
    if not 0.0 <= delay <= 10.0:
        raise ValueError(f"{STEP_DELAY_ENV}: delay {delay} outside [0, 10] seconds")
    if delay:
        log.warning("%s is set: every engine step is delayed %s s on purpose (a test hook)",
                    STEP_DELAY_ENV, delay)
    return delay
