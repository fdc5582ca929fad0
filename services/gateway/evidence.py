"""What a gateway tells the control plane about each routed version: calls, fallbacks,
client-visible errors and client feedback, aggregated per version between two reports.

Feedback arrives after the call ended, naming only a request id: `ServedLog` remembers which
version served each of this gateway's most recent requests (a bounded map; the oldest entries
are forgotten first), so a score is charged to the version that produced the output.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Mapping
from dataclasses import dataclass

from services.common import errors as e
from services.common.versions import Evidence, VersionKey, routed_counters_to_pb
from slora.v1 import placement_pb2 as ppb

DEFAULT_SERVED_CAPACITY = 100_000
MAX_LABELS = 16            # per feedback call
MAX_LABEL_CHARS = 64       # per key and per value
MAX_LABEL_KINDS = 64       # distinct "key=value" per version and report; the rest count as "other"


@dataclass
class Served:
    adapter_id: str
    version: str   # the version that produced the output (the fallback after a fallback)
    tenant: str    # who may score it: the adapter's tenant (admin keys may score anything)
    scored: bool = False


class ServedLog:
    """request_id -> the version that served it, for the `capacity` most recent requests."""

    def __init__(self, capacity: int = DEFAULT_SERVED_CAPACITY) -> None:
        if capacity < 1:
            raise ValueError(f"capacity must be >= 1, got {capacity}")
        self.capacity = capacity
        self._served: OrderedDict[str, Served] = OrderedDict()

    def __len__(self) -> int:
        return len(self._served)

    def remember(self, request_id: str, served: Served) -> None:
        self._served[request_id] = served
        self._served.move_to_end(request_id)
        while len(self._served) > self.capacity:
            self._served.popitem(last=False)

    def peek(self, request_id: str) -> Served:
        """The request's record; NotFound when unknown or forgotten."""
        served = self._served.get(request_id)
        if served is None:
            raise e.NotFound(f"request {request_id!r} is unknown here: send feedback to the "
                             f"gateway that served it, within its last {self.capacity} requests")
        return served

    def claim(self, request_id: str) -> Served:
        """The request's record, marked scored. NotFound when unknown or forgotten,
        AlreadyExists when it was scored before."""
        served = self.peek(request_id)
        if served.scored:
            raise e.AlreadyExists(f"request {request_id!r} already has a feedback score")
        served.scored = True
        return served


def check_labels(labels: Mapping[str, str]) -> None:
    if len(labels) > MAX_LABELS:
        raise e.InvalidArgument(f"at most {MAX_LABELS} feedback labels, got {len(labels)}")
    for key, value in labels.items():
        if not key or len(key) > MAX_LABEL_CHARS or len(value) > MAX_LABEL_CHARS:
            raise e.InvalidArgument(f"feedback label {key!r}: keys need 1..{MAX_LABEL_CHARS} "
                                    f"characters, values at most {MAX_LABEL_CHARS}")


class RoutedEvidence:
    """Per-version deltas since the last `drain()` (single-threaded: the gateway's loop)."""

    def __init__(self) -> None:
        self._tallies: dict[VersionKey, Evidence] = {}

    def _tally(self, key: VersionKey) -> Evidence:
        return self._tallies.setdefault(key, Evidence())

    def routed(self, key: VersionKey) -> None:
        self._tally(key).routed += 1

    def fallback(self, key: VersionKey) -> None:
        self._tally(key).fallbacks += 1

    def error(self, key: VersionKey, code: str) -> None:
        self._tally(key).count_client_error(code)

    def feedback(self, key: VersionKey, score: float, labels: Mapping[str, str]) -> None:
        t = self._tally(key)
        t.feedback_count += 1
        t.feedback_sum += score
        for k, v in labels.items():
            name = f"{k}={v}"
            if name not in t.feedback_labels and len(t.feedback_labels) >= MAX_LABEL_KINDS:
                name = "other"
            t.feedback_labels[name] = t.feedback_labels.get(name, 0) + 1

    def drain(self) -> ppb.GatewayReport | None:
        """Everything counted since the previous drain, then start from zero; None if nothing."""
        if not self._tallies:
            return None
        tallies, self._tallies = self._tallies, {}
        return ppb.GatewayReport(
            versions=[routed_counters_to_pb(k, t) for k, t in tallies.items()])
