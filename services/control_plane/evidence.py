"""Per-version evidence in the control plane: merged from worker heartbeats and gateway
reports, kept as totals since this control plane started.

Workers send cumulative counters (since the worker started); the store keeps the last copy per
worker and adds only the difference. The first heartbeat of a worker that started before this
control plane is a baseline, not news: its counters cover a past nobody can place in a window.
Gateways send deltas. Windows are differences of totals (`Evidence.minus`).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from services.common.histogram import Histogram, finite_or_zero
from slora.v1 import evidence_pb2 as epb
from slora.v1 import placement_pb2 as ppb

VersionKey = tuple[str, str]  # (adapter_id, version); ("", "") = base model


def _plus(a: Mapping[str, int], b: Mapping[str, int], sign: int = 1) -> dict[str, int]:
    out = dict(a)
    for k, v in b.items():
        out[k] = out.get(k, 0) + sign * v
    return {k: v for k, v in out.items() if v}


@dataclass
class Evidence:
    """What is known about one version over some span."""

    requests: int = 0
    errors_by_code: dict[str, int] = field(default_factory=dict)
    ttft: Histogram = field(default_factory=Histogram)
    tpot: Histogram = field(default_factory=Histogram)
    nonfinite: int = 0
    empty: int = 0
    routed: int = 0
    fallbacks: int = 0
    client_errors_by_code: dict[str, int] = field(default_factory=dict)
    feedback_count: int = 0
    feedback_sum: float = 0.0
    feedback_labels: dict[str, int] = field(default_factory=dict)

    @property
    def errors(self) -> int:
        return sum(self.errors_by_code.values())

    @property
    def failures(self) -> int:
        """Failed requests and outputs that are unusable (non-finite or empty)."""
        return self.errors + self.nonfinite + self.empty

    @property
    def samples(self) -> int:
        """Requests seen by workers or routed by gateways, whichever saw more."""
        return max(self.requests, self.routed)

    @property
    def failure_rate(self) -> float | None:
        """The larger of the worker-side rate (failures / requests) and the gateway-side rate
        ((fallbacks + client errors) / routed): a version that kills its workers leaves no
        worker-side errors, and one that fails on load shows up on both sides without being
        counted twice. None with no requests on either side."""
        rates = []
        if self.requests > 0:
            rates.append(self.failures / self.requests)
        if self.routed > 0:
            rates.append((self.fallbacks + sum(self.client_errors_by_code.values())) / self.routed)
        return min(1.0, max(rates)) if rates else None

    @property
    def feedback_mean(self) -> float | None:
        return self.feedback_sum / self.feedback_count if self.feedback_count > 0 else None

    def add(self, other: Evidence) -> None:
        """Merge `other` in place."""
        self.requests += other.requests
        self.errors_by_code = _plus(self.errors_by_code, other.errors_by_code)
        self.ttft.add(other.ttft)
        self.tpot.add(other.tpot)
        self.nonfinite += other.nonfinite
        self.empty += other.empty
        self.routed += other.routed
        self.fallbacks += other.fallbacks
        self.client_errors_by_code = _plus(self.client_errors_by_code, other.client_errors_by_code)
        self.feedback_count += other.feedback_count
        self.feedback_sum += other.feedback_sum
        self.feedback_labels = _plus(self.feedback_labels, other.feedback_labels)

    def minus(self, earlier: Evidence) -> Evidence:
        """What happened since `earlier`, a previous copy of the same totals."""
        return Evidence(
            self.requests - earlier.requests,
            _plus(self.errors_by_code, earlier.errors_by_code, -1),
            self.ttft.minus(earlier.ttft), self.tpot.minus(earlier.tpot),
            self.nonfinite - earlier.nonfinite, self.empty - earlier.empty,
            self.routed - earlier.routed, self.fallbacks - earlier.fallbacks,
            _plus(self.client_errors_by_code, earlier.client_errors_by_code, -1),
            self.feedback_count - earlier.feedback_count, self.feedback_sum - earlier.feedback_sum,
            _plus(self.feedback_labels, earlier.feedback_labels, -1),
        )

    def copy(self) -> Evidence:
        return _copy(self)

    def summary(self) -> dict[str, Any]:
        """The figures the analyzer judges by, JSON-able (audit details, status)."""
        return {
            "requests": self.requests, "errors": self.errors, "failures": self.failures,
            "client_errors_by_code": dict(self.client_errors_by_code),
            "failure_rate": self.failure_rate, "errors_by_code": dict(self.errors_by_code),
            "ttft_mean_s": self.ttft.mean(), "ttft_p90_s": self.ttft.quantile(0.9),
            "tpot_mean_s": self.tpot.mean(), "tpot_p90_s": self.tpot.quantile(0.9),
            "latency_samples": self.ttft.count, "nonfinite_outputs": self.nonfinite,
            "empty_outputs": self.empty, "routed": self.routed, "fallbacks": self.fallbacks,
            "feedback_count": self.feedback_count, "feedback_mean": self.feedback_mean,
        }

    def to_pb(self) -> epb.VersionEvidence:
        return epb.VersionEvidence(
            requests=self.requests, errors=self.errors, errors_by_code=self.errors_by_code,
            failure_rate=finite_or_zero(self.failure_rate), ttft=self.ttft.to_pb(),
            tpot=self.tpot.to_pb(), ttft_mean_s=finite_or_zero(self.ttft.mean()),
            ttft_p90_s=finite_or_zero(self.ttft.quantile(0.9)),
            tpot_mean_s=finite_or_zero(self.tpot.mean()),
            tpot_p90_s=finite_or_zero(self.tpot.quantile(0.9)),
            nonfinite_outputs=self.nonfinite, empty_outputs=self.empty, routed=self.routed,
            fallbacks=self.fallbacks, client_errors_by_code=self.client_errors_by_code,
            feedback_count=self.feedback_count, feedback_sum=self.feedback_sum,
            feedback_mean=finite_or_zero(self.feedback_mean),
            feedback_labels=self.feedback_labels,
        )


def _copy(e: Evidence) -> Evidence:
    return Evidence(e.requests, dict(e.errors_by_code), e.ttft.copy(), e.tpot.copy(),
                    e.nonfinite, e.empty, e.routed, e.fallbacks, dict(e.client_errors_by_code),
                    e.feedback_count, e.feedback_sum, dict(e.feedback_labels))


def from_worker(c: ppb.VersionCounters) -> Evidence:
    """A worker's cumulative counters of one version. Workers older than the evidence fields
    send only `errors`: those count under UNKNOWN."""
    by_code = dict(c.errors_by_code) or ({"UNKNOWN": c.errors} if c.errors else {})
    return Evidence(requests=c.requests, errors_by_code=by_code,
                    ttft=Histogram.from_pb(c.ttft), tpot=Histogram.from_pb(c.tpot),
                    nonfinite=c.nonfinite_outputs, empty=c.empty_outputs)


def from_gateway(c: ppb.RoutedCounters) -> Evidence:
    return Evidence(routed=c.requests, fallbacks=c.fallbacks,
                    client_errors_by_code=dict(c.errors_by_code),
                    feedback_count=c.feedback_count, feedback_sum=c.feedback_sum,
                    feedback_labels=dict(c.feedback_labels))


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
        current = {(c.adapter_id, c.version): from_worker(c) for c in counters}
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
                self._totals.setdefault((c.adapter_id, c.version), Evidence()).add(from_gateway(c))

    def total(self, key: VersionKey) -> Evidence:
        """A copy of the version's totals (empty when nothing was seen)."""
        with self._lock:
            found = self._totals.get(key)
            return found.copy() if found is not None else Evidence()

    def snapshot(self) -> dict[VersionKey, Evidence]:
        with self._lock:
            return {k: v.copy() for k, v in self._totals.items()}
