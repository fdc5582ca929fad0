"""Requests the engine ends on non-finite logits are canary evidence: the worker counts them
per version as non-finite outputs (once, not also as errors), the control plane's evidence
store takes them from heartbeats, and a canary that produces them is rolled back."""

from __future__ import annotations

import pytest

from services.common.versions import worker_counters_to_pb
from services.control_plane.domain.canary_policy import CanaryPolicy
from services.control_plane.domain.canary_verdict import BREACH, judge
from services.control_plane.domain.evidence import EvidenceStore
from services.worker.metrics import WorkerMetrics
from slora_core.outputs import (
    NONFINITE,
    RequestOutput,
    is_nonfinite_failure,
    nonfinite_logits_error,
)


def serve(m: WorkerMetrics, key: tuple[str, str], out: RequestOutput) -> None:
    """What the worker front does with a finished request's last output."""
    m.record_request(key)
    if is_nonfinite_failure(out):
        m.record_nonfinite_failure(key)
    else:
        m.record_finish(key, ttft=0.01, e2e=0.05, tokens=out.completion_tokens)


def test_nonfinite_failures_are_counted_once_and_roll_the_canary_back() -> None:
    ok = RequestOutput("r", finished=True, finish_reason="length", completion_tokens=5)
    broken = RequestOutput("r", finished=True, finish_reason="error",
                           error=nonfinite_logits_error(0), error_kind=NONFINITE)
    assert is_nonfinite_failure(broken) and not is_nonfinite_failure(ok)
    # Other errors are not mistaken for numeric failures.
    assert not is_nonfinite_failure(RequestOutput("r", finish_reason="error", error="adapter x"))
    m = WorkerMetrics()
    stable, canary = ("a", "v1"), ("a", "v2")
    for i in range(20):
        serve(m, stable, ok)
        serve(m, canary, broken if i % 5 == 0 else ok)
    c = m.counters[canary]
    assert (c.requests, c.nonfinite, c.errors) == (20, 4, 0)

    store = EvidenceStore(now_ms=lambda: 1_000)
    store.worker_counters("w1", 2_000, [worker_counters_to_pb(k, m.counters[k]) for k in (stable, canary)])
    ev_canary, ev_stable = store.total(canary), store.total(stable)
    assert (ev_canary.nonfinite, ev_canary.failures) == (4, 4)
    assert ev_canary.failure_rate == pytest.approx(0.2)
    policy = CanaryPolicy(window_s=60.0, min_requests=10, max_error_rate_increase=0.1)
    verdict = judge(policy, ev_canary, ev_stable, elapsed_s=1.0)
    assert verdict.kind == BREACH
    assert [check.name for check in verdict.crossed] == ["failure_rate_increase"]
    # The same traffic without the numeric failures does not breach.
    assert judge(policy, ev_stable, ev_stable, elapsed_s=120.0).kind != BREACH
