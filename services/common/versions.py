"""Adapter versions as every service names them, and the one record of what is known about a
version's traffic (`Evidence`).

Workers count the serving side (requests, failures by code, latency, unusable outputs),
gateways the routing side (routed calls, fallbacks, client-visible errors, feedback), and the
control plane merges both into the same type. On the wire a version is a `ppb.VersionKey` and
evidence travels as `ppb.VersionCounters` (worker heartbeats) or `ppb.RoutedCounters` (gateway
reports); the converters below are the only places those messages meet this type.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, fields, replace
from typing import Any

from services.common.histogram import Histogram, finite_or_zero
from slora.v1 import evidence_pb2 as epb
from slora.v1 import placement_pb2 as ppb

VersionKey = tuple[str, str]  # (adapter_id, version)
BASE_MODEL: VersionKey = ("", "")


def key_from_pb(key: ppb.VersionKey) -> VersionKey:
    return (key.adapter_id, key.version)


def key_to_pb(key: VersionKey) -> ppb.VersionKey:
    return ppb.VersionKey(adapter_id=key[0], version=key[1])


def _plus(a: Mapping[str, int], b: Mapping[str, int], sign: int = 1) -> dict[str, int]:
    out = dict(a)
    for k, v in b.items():
        out[k] = out.get(k, 0) + sign * v
    return {k: v for k, v in out.items() if v}


@dataclass
class Evidence:
    """What is known about one version over some span (cumulative or a difference)."""

    requests: int = 0
    errors_by_code: dict[str, int] = field(default_factory=dict)
    ttft: Histogram = field(default_factory=Histogram)
    tpot: Histogram = field(default_factory=Histogram)
    nonfinite: int = 0
    empty: int = 0
    completion_tokens: int = 0
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

    def count_error(self, code: str) -> None:
        """A failed request; `code` is the gRPC status code name the worker answered."""
        self.errors_by_code[code] = self.errors_by_code.get(code, 0) + 1

    def count_client_error(self, code: str) -> None:
        """A call the gateway's client saw fail, by gRPC status code name."""
        self.client_errors_by_code[code] = self.client_errors_by_code.get(code, 0) + 1

    def add(self, other: Evidence) -> None:
        """Merge `other` in place."""
        for f in fields(self):
            mine, theirs = getattr(self, f.name), getattr(other, f.name)
            if isinstance(mine, Histogram):
                mine.add(theirs)
            elif isinstance(mine, dict):
                setattr(self, f.name, _plus(mine, theirs))
            else:
                setattr(self, f.name, mine + theirs)

    def minus(self, earlier: Evidence) -> Evidence:
        """What happened since `earlier`, a previous copy of the same totals."""
        out: dict[str, Any] = {}
        for f in fields(self):
            now, then = getattr(self, f.name), getattr(earlier, f.name)
            if isinstance(now, Histogram):
                out[f.name] = now.minus(then)
            elif isinstance(now, dict):
                out[f.name] = _plus(now, then, -1)
            else:
                out[f.name] = now - then
        return Evidence(**out)

    def copy(self) -> Evidence:
        return replace(self, errors_by_code=dict(self.errors_by_code), ttft=self.ttft.copy(),
                       tpot=self.tpot.copy(), client_errors_by_code=dict(self.client_errors_by_code),
                       feedback_labels=dict(self.feedback_labels))

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


def worker_counters_to_pb(key: VersionKey, e: Evidence) -> ppb.VersionCounters:
    """A worker's cumulative counters of one version, as its heartbeat carries them."""
    return ppb.VersionCounters(
        adapter_id=key[0], version=key[1], requests=e.requests, errors=e.errors,
        completion_tokens=e.completion_tokens, ttft_seconds_sum=e.ttft.sum,
        ttft_count=e.ttft.count, tpot_seconds_sum=e.tpot.sum, tpot_count=e.tpot.count,
        errors_by_code=e.errors_by_code, ttft=e.ttft.to_pb(), tpot=e.tpot.to_pb(),
        nonfinite_outputs=e.nonfinite, empty_outputs=e.empty)


def worker_counters_from_pb(c: ppb.VersionCounters) -> Evidence:
    """A worker's cumulative counters of one version. Workers older than the evidence fields
    send only `errors`: those count under UNKNOWN."""
    by_code = dict(c.errors_by_code) or ({"UNKNOWN": c.errors} if c.errors else {})
    return Evidence(requests=c.requests, errors_by_code=by_code,
                    ttft=Histogram.from_pb(c.ttft), tpot=Histogram.from_pb(c.tpot),
                    nonfinite=c.nonfinite_outputs, empty=c.empty_outputs,
                    completion_tokens=c.completion_tokens)


def routed_counters_to_pb(key: VersionKey, e: Evidence) -> ppb.RoutedCounters:
    """A gateway's deltas of one version, as its report carries them."""
    return ppb.RoutedCounters(
        adapter_id=key[0], version=key[1], requests=e.routed, fallbacks=e.fallbacks,
        errors_by_code=e.client_errors_by_code, feedback_count=e.feedback_count,
        feedback_sum=e.feedback_sum, feedback_labels=e.feedback_labels)


def routed_counters_from_pb(c: ppb.RoutedCounters) -> Evidence:
    return Evidence(routed=c.requests, fallbacks=c.fallbacks,
                    client_errors_by_code=dict(c.errors_by_code),
                    feedback_count=c.feedback_count, feedback_sum=c.feedback_sum,
                    feedback_labels=dict(c.feedback_labels))
