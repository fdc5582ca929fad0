"""The canary analyzer over a real registry (SQLite and PostgreSQL), fed worker heartbeats as
the placement hub would, with a clock the test moves: progressive promotion, rollback with its
evidence, no flapping, two analyzers racing, a restart mid-window; and the admin API of
policies and rollout status."""

from __future__ import annotations

import datetime as dt
import json
import threading
from pathlib import Path

import grpc
import pytest
from sqlalchemy import Engine, select

from services.common.histogram import Histogram
from services.control_plane.api.server import ControlPlaneConfig, build_registry
from services.control_plane.domain.evidence import EvidenceStore
from services.control_plane.rollout.analyzer import Analyzer
from services.control_plane.store.db import make_engine, make_session_factory
from services.control_plane.store.models import AuditEvent
from services.control_plane.store.records import EventRecord
from services.control_plane.store.replay import replay
from services.control_plane.store.storage import StorageConfig
from slora.v1 import admin_pb2 as pb
from slora.v1 import placement_pb2 as ppb
from slora_core.adapters import digest_adapter_dir
from tests.services.control_plane.cp_support import BASE, MAX_RANK, RunningPlane, file_uri

T0 = dt.datetime(2030, 1, 1, tzinfo=dt.UTC)


class Clock:
    def __init__(self) -> None:
        self.now = T0

    def __call__(self) -> dt.datetime:
        return self.now

    def at(self, seconds: float) -> None:
        self.now = T0 + dt.timedelta(seconds=seconds)


class Workers:
    """Cumulative per-version counters of one worker, sent as heartbeats to evidence stores."""

    def __init__(self, *stores: EvidenceStore) -> None:
        self.stores = stores
        self.counters: dict[tuple[str, str], ppb.VersionCounters] = {}

    def serve(self, adapter: str, version: str, ok: int, failed: int = 0,
              ttft: float = 0.01) -> None:
        c = self.counters.setdefault((adapter, version), ppb.VersionCounters(
            adapter_id=adapter, version=version, ttft=Histogram().to_pb()))
        h = Histogram.from_pb(c.ttft)
        for _ in range(ok):
            h.observe(ttft)
        c.requests += ok + failed
        c.errors += failed
        c.errors_by_code["INVALID_ARGUMENT"] = c.errors
        c.ttft.CopyFrom(h.to_pb())
        for store in self.stores:
            store.worker_counters("w1", store.started_at_ms + 1, list(self.counters.values()))


def setup_adapter(plane: RunningPlane, adapter_root: Path, adapter_id: str,
                  policy: pb.CanaryPolicy, ratio: float) -> None:
    admin = plane.admin
    for v in ("v1", "v2"):
        path = adapter_root / "good" / v
        admin.register(adapter_id, v, file_uri(path), digest_adapter_dir(path), BASE, "acme")
    admin.promote(adapter_id, "v1")
    admin.set_policy(adapter_id, policy)
    admin.canary(adapter_id, "v2", ratio)


def analyzer_events(plane: RunningPlane, adapter_id: str) -> list[pb.AuditEvent]:
    return [e for e in plane.admin.events(adapter_id) if e.actor == "system:canary-analyzer"]


def second_plane(plane: RunningPlane, base_model_dir: Path, adapter_root: Path,
                 store: EvidenceStore, clock: Clock) -> tuple[Analyzer, Engine]:
    """Another control plane's analyzer: its own engine, sessions and registry on the same
    database."""
    engine = make_engine(plane.engine.url.render_as_string(hide_password=False))
    sessions = make_session_factory(engine)
    config = ControlPlaneConfig(db_url="unused", base_models={BASE: base_model_dir},
                                storage=StorageConfig(allowed_roots=(adapter_root,)),
                                max_rank=MAX_RANK)
    return Analyzer(sessions, build_registry(config, sessions), store, clock=clock), engine


STEPS = pb.CanaryPolicy(window_seconds=10, min_requests=5, max_error_rate_increase=0.1,
                        max_ttft_ratio=2.0, steps=[0.1, 0.5])


def test_healthy_canary_climbs_the_steps_then_is_promoted(plane: RunningPlane,
                                                          adapter_root: Path) -> None:
    setup_adapter(plane, adapter_root, "walk", STEPS, 0.1)
    clock, store = Clock(), EvidenceStore()
    analyzer = Analyzer(plane.sessions, plane.plane.registry, store, clock=clock)
    workers = Workers(store)
    analyzer.tick()  # opens the first window
    workers.serve("walk", "v1", ok=45)
    workers.serve("walk", "v2", ok=5)
    clock.at(5)
    analyzer.tick()
    assert plane.admin.get("walk").route.traffic_ratio == 0.1  # mid-window: nothing yet
    assert "window to end" in analyzer.live["walk"].waiting_for
    clock.at(10)
    analyzer.tick()
    route = plane.admin.get("walk").route
    assert (route.canary_version, route.traffic_ratio) == ("v2", 0.5)
    clock.at(12)
    analyzer.tick()  # a new window: the evidence before the step does not count
    assert analyzer.live["walk"].waiting_for == "0/5 canary requests"
    workers.serve("walk", "v1", ok=10)
    workers.serve("walk", "v2", ok=10, ttft=0.015)
    clock.at(20)
    analyzer.tick()
    info = plane.admin.get("walk")
    assert (info.route.stable_version, info.route.canary_version, info.route.fallback_version) == (
        "v2", "", "v1")
    events = analyzer_events(plane, "walk")
    assert [e.action for e in events] == ["canary", "promote"]
    details = json.loads(events[1].details_json)["analysis"]
    assert details["decision"] == "promote" and details["windows_passed"] == 1
    assert details["canary"]["requests"] == 10 and details["stable"]["requests"] == 10
    assert [c["check"] for c in details["checks"]] == ["failure_rate_increase", "ttft_ratio"]
    clock.at(100)
    analyzer.tick()
    assert len(analyzer_events(plane, "walk")) == 2


def test_breach_rolls_back_with_evidence_and_never_flaps(plane: RunningPlane,
                                                        adapter_root: Path) -> None:
    setup_adapter(plane, adapter_root, "bad", STEPS, 0.1)
    clock, store = Clock(), EvidenceStore()
    analyzer = Analyzer(plane.sessions, plane.plane.registry, store, clock=clock)
    workers = Workers(store)
    analyzer.tick()
    workers.serve("bad", "v1", ok=40)
    workers.serve("bad", "v2", ok=1, failed=5)
    clock.at(1)  # long before the window ends
    analyzer.tick()
    info = plane.admin.get("bad")
    assert (info.route.stable_version, info.route.canary_version) == ("v1", "")
    assert {v.version: v.state for v in info.versions}["v2"] == pb.VERSION_STATE_ROLLED_BACK
    [event] = analyzer_events(plane, "bad")
    assert event.action == "rollback" and "failure_rate_increase" in event.reason
    details = json.loads(event.details_json)["analysis"]
    assert details["crossed"] == ["failure_rate_increase"]
    assert details["canary"]["failure_rate"] == pytest.approx(5 / 6)
    assert details["policy"]["max_error_rate_increase"] == 0.1
    # The rolled-back version now looks perfect: the analyzer still never brings it back.
    for t in (20, 40, 60):
        workers.serve("bad", "v2", ok=50)
        clock.at(t)
        analyzer.tick()
    assert len(analyzer_events(plane, "bad")) == 1
    status = plane.admin.status("bad")
    assert (status.analysis.last_decision, status.analysis.last_version) == ("rollback", "v2")
    # Only an explicit admin call gives it traffic again; its analysis starts from scratch.
    plane.admin.canary("bad", "v2", 0.1, reason="fixed the data")
    clock.at(61)
    analyzer.tick()
    assert plane.admin.status("bad").analysis.windows_passed == 0


def test_two_analyzers_racing_apply_each_decision_once(plane: RunningPlane, adapter_root: Path,
                                                      base_model_dir: Path) -> None:
    setup_adapter(plane, adapter_root, "race", STEPS, 0.1)
    clock = Clock()
    stores = (EvidenceStore(), EvidenceStore())
    other, other_engine = second_plane(plane, base_model_dir, adapter_root, stores[1], clock)
    analyzers = (Analyzer(plane.sessions, plane.plane.registry, stores[0], clock=clock), other)
    workers = Workers(*stores)

    def race() -> None:
        barrier = threading.Barrier(2)
        errors: list[BaseException] = []

        def run(a: Analyzer) -> None:
            barrier.wait()
            try:
                a.tick()
            except BaseException as exc:  # reported below, not swallowed
                errors.append(exc)

        threads = [threading.Thread(target=run, args=(a,)) for a in analyzers]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert not errors, errors

    try:
        for step in range(4):
            race()  # one opens the window (again after a step); the other keeps up
            race()  # now both count this window's evidence from here
            workers.serve("race", "v1", ok=30)
            workers.serve("race", "v2", ok=10)
            clock.at(11 * (step + 1))
            race()
        events = analyzer_events(plane, "race")
        assert [e.action for e in events] == ["canary", "promote"]
        # Each decision moved the route by exactly one revision from the one before it.
        assert all(int(e.etag_after[1:]) == int(e.etag_before[1:]) + 1 for e in events)
        info = plane.admin.get("race")
        assert (info.route.stable_version, info.route.canary_version) == ("v2", "")
        won = sum(a.decisions[("race", d)] for a in analyzers for d in ("advance", "promote"))
        assert won == 2
        # The whole log replays into the stored route: an unbroken chain of revisions.
        with plane.sessions() as s:
            rows = s.scalars(select(AuditEvent).where(AuditEvent.adapter_id == "race")
                             .order_by(AuditEvent.id))
            replayed = replay([EventRecord.from_row(r) for r in rows])["race"]
        assert (replayed.stable, replayed.canary, replayed.fallback) == ("v2", None, "v1")
    finally:
        other_engine.dispose()


def test_restart_mid_window_keeps_the_analysis(plane: RunningPlane, adapter_root: Path) -> None:
    setup_adapter(plane, adapter_root, "restart", STEPS, 0.1)
    clock = Clock()
    first = Analyzer(plane.sessions, plane.plane.registry, EvidenceStore(), clock=clock)
    workers = Workers(first.evidence)
    first.tick()
    workers.serve("restart", "v1", ok=30)
    workers.serve("restart", "v2", ok=10)
    clock.at(10)
    first.tick()  # advance to 0.5, a new window opens at t=10
    first.tick()
    workers.serve("restart", "v2", ok=3)
    clock.at(15)
    # The control plane restarts: the window's start and passed windows come from the
    # database; the 3 requests seen before the restart are lost with the old process.
    second = Analyzer(plane.sessions, plane.plane.registry, EvidenceStore(), clock=clock)
    workers.stores = (second.evidence,)
    workers.counters.clear()
    second.tick()
    status = plane.admin.status("restart")
    assert status.analysis.windows_passed == 1
    assert status.analysis.window_started_at.ToDatetime(dt.UTC) == T0 + dt.timedelta(seconds=10)
    workers.serve("restart", "v1", ok=20)
    workers.serve("restart", "v2", ok=4)
    clock.at(21)
    second.tick()
    assert plane.admin.get("restart").route.canary_version == "v2"  # 4 < min_requests
    workers.serve("restart", "v2", ok=2)
    second.tick()
    assert [e.action for e in analyzer_events(plane, "restart")] == ["canary", "promote"]


# ---- admin API ------------------------------------------------------------------------------

def test_policy_changes_take_the_etag_and_leave_an_event(plane: RunningPlane,
                                                         adapter_root: Path) -> None:
    admin = plane.admin
    path = adapter_root / "good" / "v1"
    admin.register("pol", "v1", file_uri(path), digest_adapter_dir(path), BASE, "acme")
    etag = admin.get("pol").route.etag
    policy = pb.CanaryPolicy(window_seconds=30, min_requests=20, max_feedback_drop=0.3,
                             min_feedback=10, steps=[0.05, 0.25])
    info = admin.set_policy("pol", policy, etag, reason="rollout rules")
    assert info.canary_policy == policy and info.route.etag != etag
    assert admin.get("pol").canary_policy == policy
    with pytest.raises(grpc.RpcError) as stale:
        admin.set_policy("pol", None, etag)
    assert stale.value.code() == grpc.StatusCode.ABORTED
    before = plane.dump()
    for bad in (pb.CanaryPolicy(window_seconds=30, min_requests=20),
                pb.CanaryPolicy(window_seconds=30, min_requests=20, max_ttft_ratio=0.5),
                pb.CanaryPolicy(window_seconds=-1, min_requests=20, max_ttft_ratio=2)):
        with pytest.raises(grpc.RpcError) as invalid:
            admin.set_policy("pol", bad)
        assert invalid.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert plane.dump() == before
    event = admin.events("pol")[-1]
    assert (event.action, event.reason) == ("policy", "rollout rules")
    details = json.loads(event.details_json)
    assert details["policy_before"] is None and details["policy_after"]["steps"] == [0.05, 0.25]
    cleared = admin.set_policy("pol", None)
    assert not cleared.HasField("canary_policy")


def test_rollout_status_shows_live_figures(plane: RunningPlane, adapter_root: Path) -> None:
    setup_adapter(plane, adapter_root, "seen", STEPS, 0.2)
    Workers(plane.plane.evidence).serve("seen", "v2", ok=3, failed=1, ttft=0.02)
    plane.plane.evidence.gateway_report(ppb.GatewayReport(versions=[ppb.RoutedCounters(
        adapter_id="seen", version="v2", requests=4, fallbacks=1, feedback_count=2,
        feedback_sum=1.0)]))
    status = plane.admin.status("seen")
    assert status.adapter.route.canary_version == "v2"
    assert [(f.version, f.role) for f in status.figures] == [("v1", "stable"), ("v2", "canary")]
    canary = status.figures[1].total
    assert (canary.requests, canary.errors, canary.failure_rate) == (4, 1, 0.25)
    assert canary.ttft.count == 3 and canary.ttft_mean_s == pytest.approx(0.02)
    assert (canary.routed, canary.fallbacks, canary.feedback_mean) == (4, 1, 0.5)
    assert status.analysis.canary_version == "v2"
    with pytest.raises(grpc.RpcError) as missing:
        plane.admin.status("nope")
    assert missing.value.code() == grpc.StatusCode.NOT_FOUND
