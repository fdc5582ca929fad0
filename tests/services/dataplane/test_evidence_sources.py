"""Where canary evidence comes from, in isolation: the gateway's served-request log and
per-version tallies, the worker's per-version counters, and the worker's slow-version hook."""

from __future__ import annotations

import pytest

from services.common import errors as e
from services.gateway.evidence import MAX_LABEL_KINDS, RoutedEvidence, Served, ServedLog
from services.worker.debug_hooks import STEP_DELAY_ENV, parse_slow_versions, step_delay_from_env
from services.worker.metrics import WorkerMetrics


def test_served_log_is_bounded_and_takes_one_score_per_request() -> None:
    log = ServedLog(capacity=3)
    for i in range(5):
        log.remember(f"r{i}", Served("a", "v1", "acme"))
    assert len(log) == 3
    with pytest.raises(e.NotFound, match="last 3 requests"):
        log.peek("r0")  # the oldest were forgotten
    assert log.claim("r4").version == "v1"
    with pytest.raises(e.AlreadyExists):
        log.claim("r4")


def test_routed_evidence_drains_deltas() -> None:
    ev = RoutedEvidence()
    assert ev.drain() is None
    ev.routed(("a", "v2"))
    ev.routed(("a", "v2"))
    ev.fallback(("a", "v2"))
    ev.error(("a", "v2"), "UNAVAILABLE")
    ev.feedback(("a", "v1"), -0.5, {"thumb": "down"})
    for i in range(MAX_LABEL_KINDS + 2):
        ev.feedback(("a", "v1"), 1.0, {f"k{i}": "x"})
    report = ev.drain()
    assert report is not None
    by_version = {c.version: c for c in report.versions}
    v2 = by_version["v2"]
    assert (v2.requests, v2.fallbacks, dict(v2.errors_by_code)) == (2, 1, {"UNAVAILABLE": 1})
    v1 = by_version["v1"]
    assert (v1.feedback_count, v1.feedback_sum) == (MAX_LABEL_KINDS + 3, MAX_LABEL_KINDS + 1.5)
    assert len(v1.feedback_labels) == MAX_LABEL_KINDS + 1 and v1.feedback_labels["other"] == 3
    assert ev.drain() is None  # deltas: nothing since the last report


def test_worker_counters_carry_the_evidence() -> None:
    m = WorkerMetrics()
    key = ("a", "v1")
    for _ in range(3):
        m.record_request(key)
    m.record_error(key, "INVALID_ARGUMENT")
    m.record_finish(key, ttft=0.02, e2e=0.1, tokens=5)
    m.record_finish(key, ttft=None, e2e=0.01, tokens=0, nonfinite=False)
    c = m.counters[key]
    assert (c.requests, c.errors, c.errors_by_code) == (3, 1, {"INVALID_ARGUMENT": 1})
    assert (c.ttft.count, c.tpot.count, c.empty, c.nonfinite) == (1, 1, 1, 0)
    assert c.tpot.sum == pytest.approx(0.02)


def test_slow_versions_hook_parsing() -> None:
    assert parse_slow_versions("") == {}
    assert parse_slow_versions("a@v2=0.2, team/b@v1=1") == {("a", "v2"): 0.2,
                                                             ("team/b", "v1"): 1.0}
    for bad in ("a=0.1", "a@v1", "@v1=1", "a@v1=-1", "a@v1=x"):
        with pytest.raises(ValueError):
            parse_slow_versions(bad)


def test_step_delay_hook_parsing() -> None:
    assert step_delay_from_env({}) == 0.0
    assert step_delay_from_env({STEP_DELAY_ENV: " 0.01 "}) == 0.01
    for bad in ("x", "-0.1", "11", "nan"):
        with pytest.raises(ValueError, match=STEP_DELAY_ENV):
            step_delay_from_env({STEP_DELAY_ENV: bad})


def test_engine_state_counters_take_the_cumulative_differences() -> None:
    """Loads, evictions and sole-adapter merges reach the worker as running totals each step;
    the Prometheus counters add what is new since the last step."""
    m = WorkerMetrics()
    for loads, merges, merged_steps in ((2, 0, 0), (3, 1, 5), (3, 1, 9)):
        m.set_engine_state(running=1, waiting=0, kv_pages=4, adapter_pages=2, free_pages=9,
                           loads=loads, evictions=1, merges=merges, merged_steps=merged_steps)
    value = m.registry.get_sample_value
    assert value("slora_adapter_loads_total") == 3
    assert value("slora_adapter_evictions_total") == 1
    assert value("slora_adapter_merges_total") == 1
    assert value("slora_merged_steps_total") == 9
