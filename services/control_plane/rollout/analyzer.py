"""The canary analyzer: every tick, judge each running canary that has a policy, and act.

Per adapter, an analysis window belongs to one route revision. The window's start, the passing
windows so far and the last decision live in the database (`canary_analyses`), and so does the
window's evidence (`canary_evidence`): each tick adds what this process's evidence totals grew
by since the previous tick, together with the workers' counters it was taken up to
(`evidence_checkpoints`), in one transaction (store/evidence_rows.py). A control plane
restarted mid-window resumes with the window's evidence and takes the workers' next heartbeats
as news from the checkpoint, so it reaches the verdict it would have reached without the
restart (less at most one tick of gateway reports). A control plane that did not open a window
and started after it (a second control plane) counts from when it first sees it.

Decisions go through the registry's normal route transaction, under the route etag read at the
start of the tick: a rollback (the canary becomes ROLLED_BACK, traffic returns to stable), a
step up the policy's ratios, or a promotion. The analysis row is written in the same
transaction. Two analyzers racing the same decision (two control planes, or one restarted in
the middle) both compute it, but only the first commit matches the etag; the other gets
ABORTED and re-reads a route that has moved on. The analyzer only ever acts on the route's
current canary, so a version it rolled back takes traffic again only after an admin's explicit
StartCanary or Promote.
"""

from __future__ import annotations

import asyncio
import datetime as dt
import logging
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session, sessionmaker
from sqlalchemy.orm.exc import StaleDataError

from services.common.errors import Aborted
from services.common.versions import Evidence
from services.control_plane.domain import lifecycle
from services.control_plane.domain.canary_verdict import BREACH, PASS, WAIT, Verdict, judge
from services.control_plane.domain.evidence import EvidenceStore
from services.control_plane.domain.lifecycle import IllegalTransition
from services.control_plane.domain.principal import ADMIN, Principal
from services.control_plane.store.evidence_rows import (
    add_to_window,
    load_checkpoint,
    load_window,
    save_checkpoint,
)
from services.control_plane.store.models import Adapter, CanaryAnalysisRow, Route
from services.control_plane.store.records import etag_of
from services.control_plane.store.registry import Registry, Transition
from services.control_plane.store.rollout_rows import (
    AnalysisRecord,
    CanaryRun,
    load_runs,
    open_window,
    raise_stale,
    record_decision,
)

log = logging.getLogger(__name__)
ANALYZER = Principal(key_id="canary-analyzer", scope=ADMIN, kind="system")
DEFAULT_TICK_S = 0.25


def utcnow() -> dt.datetime:
    return dt.datetime.now(dt.UTC)


@dataclass(frozen=True)
class LiveWindow:
    """What the analyzer saw of a running canary at its latest tick (for status and metrics)."""

    run: CanaryRun
    started_at: dt.datetime
    elapsed_s: float
    evidence: dict[str, Evidence]  # by version: the canary's and the stable's
    waiting_for: str


@dataclass(frozen=True)
class _Seen:
    """The evidence totals of a window's versions already added to its rows."""

    route_revision: int
    totals: dict[str, Evidence]


class Analyzer:
    def __init__(self, sessions: sessionmaker[Session], registry: Registry,
                 evidence: EvidenceStore, tick_s: float = DEFAULT_TICK_S,
                 clock: Callable[[], dt.datetime] = utcnow) -> None:
        self.sessions = sessions
        self.registry = registry
        self.evidence = evidence
        self.tick_s = tick_s
        self.clock = clock
        self.decisions: Counter[tuple[str, str]] = Counter()  # (adapter_id, decision) won here
        # Replaced whole per key (atomic under the GIL): status readers in other threads see
        # either the old or the new value.
        self.live: dict[str, LiveWindow] = {}
        self._seen: dict[str, _Seen] = {}
        self._restored = False
        self.started_at = clock()  # windows opened before this are a predecessor's
    async def run(self) -> None:
        """Tick until cancelled; a failed tick (database away) is logged and retried."""
        while True:
            try:
                await asyncio.to_thread(self.tick)
            except Exception:
                log.exception("canary analysis tick failed; retrying")
            await asyncio.sleep(self.tick_s)

    def restore_evidence(self) -> None:
        """Take the workers' counters the stored windows were written up to (once; before the
        placement stream takes heartbeats, so none is mistaken for a baseline)."""
        if not self._restored:
            with self.sessions() as s:
                self.evidence.restore(load_checkpoint(s))
            self._restored = True

    def tick(self) -> None:
        self.restore_evidence()
        with self.sessions() as s:
            runs = load_runs(s)
        windows = self._persist([r for r in runs if _window_open(r)])
        for run in runs:
            self._analyze(run, windows.get(run.adapter_id))
        running = {r.adapter_id for r in runs}
        for adapter_id in set(self._seen) - running:
            del self._seen[adapter_id]
        for adapter_id in set(self.live) - running:
            del self.live[adapter_id]

    def _persist(self, runs: list[CanaryRun]) -> dict[str, dict[str, Evidence]]:
        """Add to each open window's rows what its versions' totals grew by since the last
        tick, and save the workers' counters they were taken from, in one transaction;
        returns each window's evidence by version."""
        if not runs:
            return {}
        totals, bases = self.evidence.checkpoint()
        seen: dict[str, _Seen] = {}
        windows: dict[str, dict[str, Evidence]] = {}
        with self.sessions.begin() as s:
            for run in runs:
                versions = (run.canary, run.stable)
                now = {v: totals.get((run.adapter_id, v), Evidence()) for v in versions}
                before = self._seen_before(run, now)
                add_to_window(s, run.adapter_id, run.route_revision,
                              {v: now[v].minus(before.totals[v]) for v in versions})
                windows[run.adapter_id] = load_window(s, run.adapter_id, run.route_revision,
                                                      versions)
                seen[run.adapter_id] = _Seen(run.route_revision, now)
            save_checkpoint(s, bases)
        self._seen.update(seen)
        return windows

    def _seen_before(self, run: CanaryRun, now: dict[str, Evidence]) -> _Seen:
        seen = self._seen.get(run.adapter_id)
        if seen is not None and seen.route_revision == run.route_revision:
            return seen
        assert run.analysis is not None
        if run.analysis.window_started_at < self.started_at:
            # Opened before this process started (a restart): every total here is news since
            # the checkpoint the window's rows were written with.
            return _Seen(run.route_revision, {v: Evidence() for v in now})
        # Opened by another control plane after this one started: what came before is not
        # attributable to the window; count from now.
        return _Seen(run.route_revision, now)

    # ---- one adapter --------------------------------------------------------------------
    def _analyze(self, run: CanaryRun, window: dict[str, Evidence] | None) -> None:
        a = run.analysis
        if a is None or window is None:
            passed = a.windows_passed if a is not None and a.canary_version == run.canary else 0
            self._open_window(run, passed)
            return
        now = self.clock()
        elapsed = (now - a.window_started_at).total_seconds()
        verdict = judge(run.policy, window[run.canary], window[run.stable], elapsed)
        self.live[run.adapter_id] = LiveWindow(run, a.window_started_at, elapsed, window,
                                               verdict.waiting_for)
        if verdict.kind != WAIT:
            self._decide(run, a, verdict, window, elapsed, now)

    def _mark(self, run: CanaryRun, revision: int | None = None) -> None:
        """A window this process opens starts from the totals as they are now."""
        totals = {v: self.evidence.total((run.adapter_id, v)) for v in (run.canary, run.stable)}
        self._seen[run.adapter_id] = _Seen(revision or run.route_revision, totals)

    def _open_window(self, run: CanaryRun, windows_passed: int) -> None:
        expected = run.analysis.revision if run.analysis else None
        try:
            with self.sessions.begin() as s:
                if not self._route_unchanged(s, run):
                    return
                open_window(s, run.adapter_id, run.canary, run.route_revision, windows_passed,
                            expected, self.clock())
        except (StaleDataError, IntegrityError):
            log.info("%s: another analyzer opened the window first", run.adapter_id)
            return
        self._mark(run)

    @staticmethod
    def _route_unchanged(s: Session, run: CanaryRun) -> bool:
        # Lock the route row first, like every route change, so analysis writes for an
        # adapter are serialized with route changes and with each other.
        route = s.get(Route, run.adapter_id, with_for_update=True)
        return route is not None and route.revision == run.route_revision

    # ---- decisions ----------------------------------------------------------------------
    def _decide(self, run: CanaryRun, a: AnalysisRecord, verdict: Verdict,
                window: dict[str, Evidence], elapsed: float, now: dt.datetime) -> None:
        decision, action, transition, args = self._plan(run, verdict)
        details = {"analysis": {
            "decision": decision, "policy": run.policy.to_dict(), "elapsed_s": round(elapsed, 3),
            "traffic_ratio": run.traffic_ratio, "windows_passed": a.windows_passed,
            "canary": {"version": run.canary, **window[run.canary].summary()},
            "stable": {"version": run.stable, **window[run.stable].summary()},
            "checks": [c.to_dict() for c in verdict.checks],
            "crossed": [c.name for c in verdict.crossed],
        }}
        reason = verdict.reason()
        passed = a.windows_passed + (verdict.kind == PASS)
        try:
            if action is None:
                self._record_pass(run, a, reason, details, now)
            else:
                self._change(run, a, decision, action, transition, args, reason, details,
                             passed, now)
        except (Aborted, IllegalTransition, StaleDataError, IntegrityError) as exc:
            log.info("%s: decision %s not applied (%s); re-reading", run.adapter_id, decision, exc)
            return
        self.decisions[(run.adapter_id, decision)] += 1
        log.warning("%s@%s: %s (%s)", run.adapter_id, run.canary, decision, reason)

    @staticmethod
    def _plan(run: CanaryRun, verdict: Verdict
              ) -> tuple[str, str | None, Transition, dict[str, Any]]:
        if verdict.kind == BREACH:
            return "rollback", "rollback", lifecycle.rollback, {}
        if not run.policy.steps:
            return "pass", None, _same, {}
        step = run.policy.next_step(run.traffic_ratio)
        if step is not None:
            return ("advance", "canary",
                    lambda st: lifecycle.start_canary(st, run.canary, step), {"traffic_ratio": step})
        return "promote", "promote", lambda st: lifecycle.promote(st, run.canary), {}

    def _change(self, run: CanaryRun, a: AnalysisRecord, decision: str, action: str,
                transition: Transition, args: dict[str, Any], reason: str,
                details: dict[str, Any], passed: int, now: dt.datetime) -> None:
        def hook(s: Session, adapter: Adapter, new_revision: int) -> dict[str, Any]:
            row = s.get(CanaryAnalysisRow, run.adapter_id)
            if row is None or row.revision != a.revision:
                raise_stale(run.adapter_id)
            record_decision(row, decision, run.canary, reason, details, now)
            row.route_revision, row.window_started_at = new_revision, now
            row.canary_version = adapter.route.canary_version
            row.windows_passed = passed if row.canary_version == run.canary else 0
            return details

        record = self.registry.change_route(run.adapter_id, etag_of(run.route_revision),
                                            ANALYZER, action, reason, run.canary, transition,
                                            args, hook=hook)
        self._mark(run, record.route.revision)

    def _record_pass(self, run: CanaryRun, a: AnalysisRecord, reason: str,
                     details: dict[str, Any], now: dt.datetime) -> None:
        """A passing window without steps: recorded, and the next window starts now."""
        with self.sessions.begin() as s:
            if not self._route_unchanged(s, run):
                raise Aborted(f"{run.adapter_id} changed during the analysis")
            row = open_window(s, run.adapter_id, run.canary, run.route_revision,
                              a.windows_passed + 1, a.revision, now)
            record_decision(row, "pass", run.canary, reason, details, now)
        self._mark(run)


def _window_open(run: CanaryRun) -> bool:
    """The analysis row holds the window of the route's current revision and canary."""
    a = run.analysis
    return a is not None and a.route_revision == run.route_revision and \
        a.canary_version == run.canary


def _same(state: lifecycle.AdapterState) -> lifecycle.AdapterState:
    return state
