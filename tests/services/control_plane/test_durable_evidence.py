"""Canary evidence lives in the registry database (SQLite and PostgreSQL): a control plane
restarted twice in the middle of a canary's window reaches the verdict, at the same moment and
on the same counts, that the same canary reaches without restarts, including what a worker
counted between the last write and each restart.

The canary fails early (3 of 10 requests in each of its first three seconds) and is healthy
after: on the whole window that is a breach (9 failures in 60 requests, +0.15 > 0.1), while a
control plane that forgot the window at a restart would see only healthy traffic and wait."""

from __future__ import annotations

import datetime as dt
import json
from pathlib import Path

from services.common.histogram import Histogram
from services.control_plane.domain.evidence import EvidenceStore
from services.control_plane.rollout.analyzer import Analyzer
from slora.v1 import admin_pb2 as pb
from slora.v1 import placement_pb2 as ppb
from tests.services.control_plane.cp_support import RunningPlane
from tests.services.control_plane.test_canary_analyzer import Clock, analyzer_events, setup_adapter

POLICY = pb.CanaryPolicy(window_seconds=100, min_requests=60, max_error_rate_increase=0.1)
STEPS = 12
WORKER_STARTED_MS = 1  # the worker has run since long before any control plane here


class Worker:
    """One worker's cumulative counters, heartbeat to whichever control plane is up."""

    def __init__(self) -> None:
        self.counters: dict[tuple[str, str], ppb.VersionCounters] = {}

    def serve(self, adapter: str, version: str, ok: int, failed: int = 0) -> None:
        c = self.counters.setdefault((adapter, version), ppb.VersionCounters(
            adapter_id=adapter, version=version, ttft=Histogram().to_pb()))
        c.requests += ok + failed
        c.errors += failed
        c.errors_by_code["INTERNAL"] = c.errors

    def heartbeat(self, store: EvidenceStore) -> None:
        store.worker_counters("w1", WORKER_STARTED_MS, list(self.counters.values()))


def run_canary(plane: RunningPlane, adapter_root: Path, adapter: str,
               restarts: tuple[int, ...]) -> tuple[int | None, dict]:
    """Serve the canary second by second, restarting the control plane (a new evidence store
    and analyzer on the same database) before the ticks of `restarts`; returns the second of
    the analyzer's decision (None: none) and its recorded analysis."""
    setup_adapter(plane, adapter_root, adapter, POLICY, 0.5)
    clock, worker = Clock(), Worker()

    def start() -> Analyzer:
        analyzer = Analyzer(plane.sessions, plane.plane.registry, EvidenceStore(), clock=clock)
        analyzer.restore_evidence()  # as `serve` does, before the placement stream opens
        worker.heartbeat(analyzer.evidence)  # the worker (re)connects: counters so far
        return analyzer

    analyzer = start()
    analyzer.tick()  # opens the window at t=0
    for second in range(1, STEPS + 1):
        clock.at(second)
        worker.serve(adapter, "v1", ok=10)
        worker.serve(adapter, "v2", ok=7 if second <= 3 else 10, failed=3 if second <= 3 else 0)
        worker.heartbeat(analyzer.evidence)
        if second in restarts:
            # Killed after the heartbeat, before the tick that would have saved it.
            analyzer = start()
        analyzer.tick()
        if plane.admin.get(adapter).route.canary_version != "v2":
            event = analyzer_events(plane, adapter)[-1]
            return second, json.loads(event.details_json)["analysis"]
    return None, {}


def test_a_canary_restarted_twice_mid_window_reaches_the_same_verdict(
        plane: RunningPlane, adapter_root: Path) -> None:
    steady_at, steady = run_canary(plane, adapter_root, "durable-a", restarts=())
    restarted_at, restarted = run_canary(plane, adapter_root, "durable-b", restarts=(2, 4))
    assert steady_at == 6 and steady["decision"] == "rollback"
    assert (restarted_at, restarted["decision"]) == (steady_at, steady["decision"])
    for version in ("canary", "stable"):
        for figure in ("requests", "failures"):
            assert restarted[version][figure] == steady[version][figure], (version, figure)
    assert restarted["canary"]["requests"] == 60 and restarted["canary"]["failures"] == 9


def test_window_evidence_survives_in_the_database(plane: RunningPlane,
                                                  adapter_root: Path) -> None:
    """What the analyzer saw is in `canary_evidence` and read back by a new process."""
    setup_adapter(plane, adapter_root, "durable-c", POLICY, 0.5)
    clock, worker = Clock(), Worker()
    first = Analyzer(plane.sessions, plane.plane.registry, EvidenceStore(), clock=clock)
    first.restore_evidence()
    worker.heartbeat(first.evidence)
    first.tick()
    worker.serve("durable-c", "v2", ok=5, failed=1)
    worker.heartbeat(first.evidence)
    clock.at(1)
    first.tick()
    clock.now += dt.timedelta(seconds=1)
    second = Analyzer(plane.sessions, plane.plane.registry, EvidenceStore(), clock=clock)
    second.restore_evidence()
    second.tick()
    live = second.live["durable-c"].evidence["v2"]
    assert (live.requests, live.failures) == (6, 1)
