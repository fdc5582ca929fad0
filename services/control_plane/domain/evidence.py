"""Per-version evidence (`services.common.versions.Evidence`) in the control plane: merged
from worker heartbeats and gateway reports, kept as totals since this control plane started.

Workers send cumulative counters (since the worker started); the store keeps the last copy per
worker and adds only the difference. The first heartbeat of a worker that started before this
control plane is a baseline, not news: its counters cover a past nobody can place in a window.
Gateways send deltas. Windows are differences of totals (`Evidence.minus`).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterable

from services.common.versions import (
    Evidence,
    VersionKey,
    routed_counters_from_pb,
    worker_counters_from_pb,
)
from slora.v1 import placement_pb2 as ppb

# A worker's cumulative counters as last received: (its started_at_ms, {version: counters}).
WorkerBase = tuple[int, dict[VersionKey, Evidence]]


class EvidenceStore:
    """Totals per version since this control plane started. Thread-safe: the placement hub
    writes from the event loop, the analyzer and the metrics endpoint read from threads."""

    def __init__(self, now_ms: Callable[[], int] = lambda: int(time.time() * 1000)) -> None:
        self.started_at_ms = now_ms()
        self._lock = threading.Lock()
        self._totals: dict[VersionKey, Evidence] = {}
        self._workers: dict[str, tuple[int, dict[VersionKey, Evidence]]] = {}

    def worker_counters(self, worker_id: str, started_at_ms: int,
                        counters: Iterable[ppb.VersionCounters]) -> None:
        """Add what a worker's cumulative counters say happened since its previous heartbeat."""
        current = {(c.adapter_id, c.version): worker_counters_from_pb(c) for c in counters}
        with self._lock:
            previous = self._workers.get(worker_id)
            if previous is None:
                # Started after us: everything it counted is news. Before us: a baseline.
                base = {} if started_at_ms >= self.started_at_ms else current
            elif previous[0] != started_at_ms:
                base = {}  # the worker restarted: its counters began again from zero
            else:
                base = previous[1]
            for key, cumulative in current.items():
                delta = cumulative.minus(base[key]) if key in base else cumulative
                if delta.requests or delta.failures or delta.ttft.count:
                    self._totals.setdefault(key, Evidence()).add(delta)
            self._workers[worker_id] = (started_at_ms, current)

    def gateway_report(self, report: ppb.GatewayReport) -> None:
        with self._lock:
            for c in report.versions:
                key = (c.adapter_id, c.version)
                self._totals.setdefault(key, Evidence()).add(routed_counters_from_pb(c))

    def checkpoint(self) -> tuple[dict[VersionKey, Evidence], dict[str, WorkerBase]]:
        """Copies of the totals and of each worker's last cumulative counters, taken together:
        the window evidence the analyzer persists from the totals is exactly what the workers'
        counters had reached (store/evidence_rows.py)."""
        with self._lock:
            totals = {k: v.copy() for k, v in self._totals.items()}
            bases = {w: (started, {k: v.copy() for k, v in counters.items()})
                     for w, (started, counters) in self._workers.items()}
        return totals, bases

    def restore(self, bases: dict[str, WorkerBase]) -> None:
        """Take a previous process's checkpoint of the workers' counters: a worker's next
        heartbeat (same start) is then news from there, not a baseline. Workers already heard
        from keep what they sent."""
        with self._lock:
            for worker_id, base in bases.items():
                self._workers.setdefault(worker_id, base)

    def total(self, key: VersionKey) -> Evidence:
        """A copy of the version's totals (empty when nothing was seen)."""
        with self._lock:
            found = self._totals.get(key)
            return found.copy() if found is not None else Evidence()

    def snapshot(self) -> dict[VersionKey, Evidence]:
        with self._lock:
            return {k: v.copy() for k, v in self._totals.items()}
