"""A mergeable latency histogram: fixed bucket bounds, plain counts (workers, control plane).

Workers keep one per adapter version and send it in heartbeats; the control plane subtracts
successive cumulative copies to get what happened in between, and adds copies from several
workers. Both only work between histograms with the same bounds, which every service takes
from `services.common.metrics.LATENCY_BUCKETS`.
"""

from __future__ import annotations

import bisect
import math
from dataclasses import dataclass, field

from services.common.metrics import LATENCY_BUCKETS
from slora.v1 import evidence_pb2 as epb


@dataclass
class Histogram:
    """Counts per bucket: `counts[i]` holds values <= bounds[i] (and > bounds[i-1]); the last
    count is the +Inf bucket."""

    bounds: tuple[float, ...] = LATENCY_BUCKETS
    counts: list[int] = field(default_factory=list)
    sum: float = 0.0
    count: int = 0

    def __post_init__(self) -> None:
        if not self.counts:
            self.counts = [0] * (len(self.bounds) + 1)
        if len(self.counts) != len(self.bounds) + 1:
            raise ValueError(f"{len(self.counts)} counts for {len(self.bounds)} bounds")

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(self.bounds, value)] += 1
        self.sum += value
        self.count += 1

    def _check(self, other: Histogram) -> None:
        if other.bounds != self.bounds:
            raise ValueError("histograms with different bucket bounds do not merge")

    def add(self, other: Histogram) -> None:
        """Merge `other` into this one (in place)."""
        self._check(other)
        self.counts = [a + b for a, b in zip(self.counts, other.counts, strict=True)]
        self.sum += other.sum
        self.count += other.count

    def minus(self, earlier: Histogram) -> Histogram:
        """What was observed since `earlier`, a previous copy of the same cumulative histogram."""
        self._check(earlier)
        return Histogram(self.bounds, [a - b for a, b in zip(self.counts, earlier.counts, strict=True)],
                         self.sum - earlier.sum, self.count - earlier.count)

    def copy(self) -> Histogram:
        return Histogram(self.bounds, list(self.counts), self.sum, self.count)

    def mean(self) -> float | None:
        return self.sum / self.count if self.count > 0 else None

    def quantile(self, q: float) -> float | None:
        """The q-quantile, interpolated linearly inside its bucket (the +Inf bucket answers with
        the largest bound); None when empty."""
        if self.count <= 0:
            return None
        rank = q * self.count
        seen = 0
        for i, n in enumerate(self.counts):
            if n > 0 and seen + n >= rank:
                if i == len(self.bounds):
                    return self.bounds[-1]
                low = self.bounds[i - 1] if i > 0 else 0.0
                return low + (self.bounds[i] - low) * max(0.0, rank - seen) / n
            seen += n
        return self.bounds[-1]

    def to_pb(self) -> epb.LatencyHistogram:
        return epb.LatencyHistogram(upper_bounds=self.bounds, counts=self.counts, sum=self.sum,
                                    count=self.count)

    @classmethod
    def from_pb(cls, msg: epb.LatencyHistogram) -> Histogram:
        """An empty histogram (standard bounds) for an unset message."""
        if not msg.upper_bounds:
            return cls()
        return cls(tuple(msg.upper_bounds), list(msg.counts), msg.sum, msg.count)


def finite_or_zero(value: float | None) -> float:
    """Protobuf fields for optional figures: 0 stands for 'no data'."""
    return value if value is not None and math.isfinite(value) else 0.0
