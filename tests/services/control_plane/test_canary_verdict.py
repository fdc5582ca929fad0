"""The pure parts of canary analysis: policies, histograms, evidence arithmetic, verdicts."""

from __future__ import annotations

import math

import pytest

from services.common.errors import InvalidArgument
from services.common.histogram import Histogram
from services.common.versions import Evidence
from services.control_plane.domain.canary_policy import CanaryPolicy
from services.control_plane.domain.canary_verdict import BREACH, PASS, WAIT, judge
from services.control_plane.domain.evidence import EvidenceStore
from slora.v1 import placement_pb2 as ppb


def evidence(requests: int, errors: int = 0, ttft: float = 0.01, tpot: float = 0.005,
             feedback: tuple[float, ...] = (), empty: int = 0) -> Evidence:
    e = Evidence(requests=requests, errors_by_code={"INVALID_ARGUMENT": errors} if errors else {},
                 empty=empty)
    for _ in range(requests - errors):
        e.ttft.observe(ttft)
        e.tpot.observe(tpot)
    e.feedback_count, e.feedback_sum = len(feedback), sum(feedback)
    return e


# ---- policy ---------------------------------------------------------------------------------

@pytest.mark.parametrize(("kwargs", "message"), [
    ({"window_s": 0}, "window_seconds"),
    ({"window_s": math.nan}, "window_seconds"),
    ({"min_requests": 0}, "min_requests"),
    ({"max_error_rate_increase": 1.5}, "max_error_rate_increase"),
    ({"max_ttft_ratio": 0.5}, "max_ttft_ratio"),
    ({"max_feedback_drop": math.nan}, "max_feedback_drop"),
    ({"max_error_rate_increase": None}, "at least one threshold"),
    ({"steps": (0.5, 0.25)}, "rise strictly"),
    ({"steps": (0.5, 1.0)}, "promotion follows the last step"),
    ({"min_feedback": 0}, "min_feedback"),
])
def test_bad_policies_are_refused(kwargs: dict, message: str) -> None:
    base = {"window_s": 10.0, "min_requests": 5, "max_error_rate_increase": 0.1}
    with pytest.raises(InvalidArgument, match=message):
        CanaryPolicy(**{**base, **kwargs})


def test_steps_and_round_trip() -> None:
    p = CanaryPolicy(10.0, 5, max_ttft_ratio=2.0, steps=(0.05, 0.25, 0.5))
    assert [p.next_step(r) for r in (0.01, 0.05, 0.1, 0.25, 0.5, 0.7)] == [
        0.05, 0.25, 0.25, 0.5, None, None]
    assert CanaryPolicy.from_dict(p.to_dict()) == p


# ---- histograms and evidence ----------------------------------------------------------------

def test_histogram_merge_difference_quantile() -> None:
    a, b = Histogram(), Histogram()
    for v in (0.002, 0.02, 0.02, 0.2):
        a.observe(v)
    b.observe(3.0)
    merged = a.copy()
    merged.add(b)
    assert merged.count == 5 and merged.sum == pytest.approx(3.242)
    assert merged.minus(a).counts == b.counts
    assert a.quantile(0.5) is not None and 0.01 < a.quantile(0.5) <= 0.025
    assert Histogram().quantile(0.5) is None
    with pytest.raises(ValueError, match="bounds"):
        a.add(Histogram(bounds=(1.0,)))
    assert Histogram.from_pb(a.to_pb()) == a


def test_evidence_add_minus_rates() -> None:
    e = evidence(10, errors=2, empty=1, feedback=(1.0, -1.0, 0.5))
    assert (e.errors, e.failures, e.failure_rate) == (2, 3, 0.3)
    assert e.feedback_mean == pytest.approx(0.5 / 3)
    total = e.copy()
    total.add(evidence(5))
    assert total.minus(e).requests == 5 and total.minus(e).errors_by_code == {}
    assert Evidence().failure_rate is None and Evidence().feedback_mean is None
    # Gateway-side failures count too (a version that kills its workers reports nothing
    # itself), without adding to the worker-side ones.
    crashing = Evidence(routed=10, client_errors_by_code={"UNAVAILABLE": 4})
    assert (crashing.samples, crashing.failure_rate) == (10, 0.4)
    both = evidence(10, errors=10)
    both.routed, both.fallbacks = 10, 10
    assert both.failure_rate == 1.0


def counters(adapter: str, requests: int, errors: int = 0) -> ppb.VersionCounters:
    c = ppb.VersionCounters(adapter_id=adapter, version="v1", requests=requests, errors=errors,
                            errors_by_code={"INTERNAL": errors} if errors else {})
    h = Histogram()
    for _ in range(requests):
        h.observe(0.01)
    c.ttft.CopyFrom(h.to_pb())
    return c


def test_worker_counters_become_deltas() -> None:
    now = [1_000_000]
    store = EvidenceStore(now_ms=lambda: now[0])
    # A worker that started before this control plane: its first heartbeat is a baseline.
    store.worker_counters("old", 999_000, [counters("a", 50, errors=5)])
    assert store.total(("a", "v1")).requests == 0
    store.worker_counters("old", 999_000, [counters("a", 53, errors=6)])
    assert (store.total(("a", "v1")).requests, store.total(("a", "v1")).errors) == (3, 1)
    # A worker that started after it: everything counts. Then it restarts: counters from zero.
    store.worker_counters("new", 1_000_500, [counters("a", 4)])
    store.worker_counters("new", 1_002_000, [counters("a", 2)])
    total = store.total(("a", "v1"))
    assert (total.requests, total.ttft.count) == (9, 9)
    # Gateways send deltas: routed calls, fallbacks, feedback.
    store.gateway_report(ppb.GatewayReport(versions=[ppb.RoutedCounters(
        adapter_id="a", version="v1", requests=7, fallbacks=2, feedback_count=2,
        feedback_sum=-1.5, feedback_labels={"thumb=down": 2})]))
    total = store.total(("a", "v1"))
    assert (total.routed, total.fallbacks, total.feedback_mean) == (7, 2, -0.75)
    assert total.feedback_labels == {"thumb=down": 2}


# ---- verdicts -------------------------------------------------------------------------------

POLICY = CanaryPolicy(window_s=10.0, min_requests=10, max_error_rate_increase=0.1,
                      max_ttft_ratio=2.0, max_tpot_ratio=2.0, max_feedback_drop=0.5,
                      min_feedback=3)
GOOD_FEEDBACK = (1.0, 0.5, 1.0)


def test_no_decision_before_min_requests() -> None:
    v = judge(POLICY, evidence(9, errors=9), evidence(100), elapsed_s=60)
    assert v.kind == WAIT and v.waiting_for == "9/10 canary requests"


@pytest.mark.parametrize(("canary", "crossed"), [
    (evidence(20, errors=4, feedback=GOOD_FEEDBACK), ["failure_rate_increase"]),
    (evidence(20, empty=4, feedback=GOOD_FEEDBACK), ["failure_rate_increase"]),
    (evidence(20, ttft=0.05, feedback=GOOD_FEEDBACK), ["ttft_ratio"]),
    (evidence(20, tpot=0.05, feedback=GOOD_FEEDBACK), ["tpot_ratio"]),
    (evidence(20, feedback=(-1.0, -1.0, 0.0)), ["feedback_drop"]),
])
def test_breach_rolls_back_even_mid_window(canary: Evidence, crossed: list[str]) -> None:
    v = judge(POLICY, canary, evidence(100, errors=1, feedback=GOOD_FEEDBACK), elapsed_s=1.0)
    assert v.kind == BREACH
    assert [c.name for c in v.crossed] == crossed
    assert crossed[0] in v.reason()


def test_pass_needs_the_whole_window_and_every_check() -> None:
    stable = evidence(100, feedback=GOOD_FEEDBACK)
    good = evidence(20, ttft=0.015, feedback=GOOD_FEEDBACK)
    assert judge(POLICY, good, stable, elapsed_s=5.0).kind == WAIT
    v = judge(POLICY, good, stable, elapsed_s=10.0)
    assert v.kind == PASS and not v.crossed and len(v.checks) == 4
    # Feedback configured but missing: the window stays open instead of passing blind.
    v = judge(POLICY, evidence(20), stable, elapsed_s=30.0)
    assert v.kind == WAIT and "feedback_drop" in v.waiting_for
    # Stable latency unknown: the latency checks wait too.
    v = judge(POLICY, good, evidence(3, feedback=GOOD_FEEDBACK), elapsed_s=30.0)
    assert v.kind == WAIT and "ttft_ratio" in v.waiting_for


def test_error_check_alone_compares_with_zero_without_stable_traffic() -> None:
    policy = CanaryPolicy(window_s=1.0, min_requests=5, max_error_rate_increase=0.2)
    assert judge(policy, evidence(10, errors=1), Evidence(), elapsed_s=2).kind == PASS
    assert judge(policy, evidence(10, errors=3), Evidence(), elapsed_s=2).kind == BREACH
