"""The placement planner: which worker keeps which adapter versions warm. Pure functions.

- Popular versions are pinned on every worker (they are called everywhere, so every worker
  should serve them without a load).
- The rest are spread by consistent hashing with bounded loads (Mirrokni, Thorup and
  Zadimoghaddam, 2018): a version goes to the first worker clockwise from its hash on a ring
  of virtual nodes whose load is under `ceil(balance * average)` and under its own capacity.
  A join or a leave moves only the versions that hashed onto the changed worker (plus the few
  that the load bound pushes on), not a reshuffle of everything.
"""

from __future__ import annotations

import bisect
import hashlib
import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

from services.common.versions import VersionKey

PREFETCH, PIN = "prefetch", "pin"
VIRTUAL_NODES = 64
DEFAULT_CAPACITY = 64


def stable_hash(text: str) -> int:
    """A 64-bit hash that is the same in every process (unlike `hash()`)."""
    return int.from_bytes(hashlib.sha256(text.encode("utf-8")).digest()[:8], "big")


@dataclass(frozen=True)
class WorkerSlot:
    worker_id: str
    capacity: int = DEFAULT_CAPACITY  # versions it can keep warm


@dataclass(frozen=True)
class PlannerConfig:
    balance: float = 1.25        # load bound as a multiple of the average (> 1)
    max_popular: int = 8         # at most this many versions pinned everywhere
    popular_share: float = 0.05  # a version is popular from this share of all requests on


class Ring:
    """Consistent-hash ring of `VIRTUAL_NODES` points per worker."""

    def __init__(self, worker_ids: Iterable[str]) -> None:
        points = sorted((stable_hash(f"{w}#{i}"), w) for w in worker_ids
                        for i in range(VIRTUAL_NODES))
        self._hashes = [h for h, _ in points]
        self._owners = [w for _, w in points]

    def walk(self, key: str) -> Iterable[str]:
        """Workers in ring order from `key`'s position, each once."""
        if not self._owners:
            return
        start = bisect.bisect(self._hashes, stable_hash(key))
        seen: set[str] = set()
        for i in range(len(self._owners)):
            owner = self._owners[(start + i) % len(self._owners)]
            if owner not in seen:
                seen.add(owner)
                yield owner


def popular_versions(rates: Mapping[VersionKey, float], config: PlannerConfig) -> set[VersionKey]:
    """The versions that take at least `popular_share` of all traffic, `max_popular` at most."""
    total = sum(rates.values())
    if total <= 0:
        return set()
    ranked = sorted(rates.items(), key=lambda kv: (-kv[1], kv[0]))
    return {k for k, rate in ranked[: config.max_popular] if rate / total >= config.popular_share}


def plan(versions: Sequence[VersionKey], workers: Sequence[WorkerSlot],
         popular: set[VersionKey], config: PlannerConfig = PlannerConfig(),
         ) -> dict[str, dict[VersionKey, str]]:
    """worker_id -> {version: PIN or PREFETCH}. Versions with no room anywhere stay unplaced
    (workers still load them on demand). Deterministic: the same inputs give the same plan."""
    result: dict[str, dict[VersionKey, str]] = {w.worker_id: {} for w in workers}
    if not workers:
        return result
    pinned = sorted(v for v in set(versions) if v in popular)
    for w in workers:
        for v in pinned[: w.capacity]:
            result[w.worker_id][v] = PIN
    rest = sorted({v for v in versions if v not in popular}, key=_ring_key)
    room = {w.worker_id: max(0, w.capacity - len(result[w.worker_id])) for w in workers}
    bound = math.ceil(config.balance * len(rest) / len(workers)) if rest else 0
    load = dict.fromkeys(room, 0)
    ring = Ring(room)
    for v in rest:
        for owner in ring.walk(_ring_key(v)):
            if load[owner] < min(bound, room[owner]):
                result[owner][v] = PREFETCH
                load[owner] += 1
                break
    return result


def _ring_key(v: VersionKey) -> str:
    return f"{v[0]}@{v[1]}"


def moved(before: Mapping[str, Mapping[VersionKey, str]],
          after: Mapping[str, Mapping[VersionKey, str]]) -> set[VersionKey]:
    """Versions (not pinned) whose worker changed between two plans."""
    def owners(p: Mapping[str, Mapping[VersionKey, str]]) -> dict[VersionKey, str]:
        return {v: w for w, vs in p.items() for v, r in vs.items() if r == PREFETCH}

    a, b = owners(before), owners(after)
    return {v for v in a.keys() & b.keys() if a[v] != b[v]}
