"""Test hooks for canary analysis, off unless their environment variable is set.

`SLORA_DEBUG_SLOW_VERSIONS="ADAPTER@VERSION=SECONDS[,...]"` makes the worker sleep SECONDS
before every chunk it streams for those versions: a slow canary on demand, so tests (and
operators trying a policy) can watch the analyzer roll it back on latency. Never set it in
production; the worker logs a warning at start-up when it is set.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping

from services.common.versions import VersionKey

log = logging.getLogger(__name__)
SLOW_VERSIONS_ENV = "SLORA_DEBUG_SLOW_VERSIONS"


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
