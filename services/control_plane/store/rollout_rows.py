"""Reading and writing the canary policy and analysis rows, inside the caller's transaction."""

from __future__ import annotations

import datetime as dt
from dataclasses import dataclass
from typing import Any, NoReturn

from sqlalchemy import select
from sqlalchemy.orm import Session
from sqlalchemy.orm.exc import StaleDataError

from services.control_plane.domain.canary_policy import CanaryPolicy
from services.control_plane.store.models import Adapter, CanaryAnalysisRow, CanaryPolicyRow, Route
from services.control_plane.store.records import as_utc, policy_of


def write_policy(session: Session, adapter: Adapter, policy: CanaryPolicy | None,
                 actor: str) -> dict[str, Any]:
    """Upsert (or delete, for None) the adapter's policy row; returns audit details."""
    before = policy_of(adapter.policy)
    if policy is None:
        if adapter.policy is not None:
            session.delete(adapter.policy)
            adapter.policy = None
    else:
        row = adapter.policy or CanaryPolicyRow(adapter_id=adapter.adapter_id)
        row.window_s, row.min_requests = policy.window_s, policy.min_requests
        row.min_feedback = policy.min_feedback
        row.max_error_rate_increase = policy.max_error_rate_increase
        row.max_ttft_ratio, row.max_tpot_ratio = policy.max_ttft_ratio, policy.max_tpot_ratio
        row.max_feedback_drop, row.steps = policy.max_feedback_drop, list(policy.steps)
        row.updated_at, row.updated_by = dt.datetime.now(dt.UTC), actor
        adapter.policy = row
    return {"policy_before": before.to_dict() if before else None,
            "policy_after": policy.to_dict() if policy else None}


@dataclass(frozen=True)
class CanaryRun:
    """One adapter with a running canary and a policy, as the analyzer reads it."""

    adapter_id: str
    tenant: str
    stable: str
    canary: str
    traffic_ratio: float
    route_revision: int
    policy: CanaryPolicy
    analysis: AnalysisRecord | None


@dataclass(frozen=True)
class AnalysisRecord:
    canary_version: str | None
    route_revision: int
    window_started_at: dt.datetime
    windows_passed: int
    last_decision: str | None
    last_version: str | None
    last_decision_at: dt.datetime | None
    last_reason: str
    last_details: dict[str, Any]
    revision: int

    @classmethod
    def from_row(cls, row: CanaryAnalysisRow) -> AnalysisRecord:
        return cls(row.canary_version, row.route_revision, as_utc(row.window_started_at),
                   row.windows_passed, row.last_decision, row.last_version,
                   as_utc(row.last_decision_at) if row.last_decision_at else None,
                   row.last_reason, dict(row.last_details or {}), row.revision)


def load_runs(session: Session) -> list[CanaryRun]:
    """Every adapter whose route has a canary and which has a canary policy."""
    query = (select(Adapter, Route, CanaryPolicyRow, CanaryAnalysisRow)
             .join(Route, Route.adapter_id == Adapter.adapter_id)
             .join(CanaryPolicyRow, CanaryPolicyRow.adapter_id == Adapter.adapter_id)
             .outerjoin(CanaryAnalysisRow, CanaryAnalysisRow.adapter_id == Adapter.adapter_id)
             .where(Route.canary_version.is_not(None), Route.stable_version.is_not(None))
             .order_by(Adapter.adapter_id))
    runs = []
    for adapter, route, policy_row, analysis in session.execute(query).unique():
        policy = policy_of(policy_row)
        if route.stable_version is None or route.canary_version is None or policy is None:
            continue  # excluded by the query; this narrows the types
        runs.append(CanaryRun(
            adapter.adapter_id, adapter.tenant, route.stable_version, route.canary_version,
            route.traffic_ratio, route.revision, policy,
            AnalysisRecord.from_row(analysis) if analysis else None))
    return runs


def load_analysis(session: Session, adapter_id: str) -> AnalysisRecord | None:
    row = session.get(CanaryAnalysisRow, adapter_id)
    return AnalysisRecord.from_row(row) if row else None


def open_window(session: Session, adapter_id: str, canary: str, route_revision: int,
                windows_passed: int, expected_revision: int | None,
                now: dt.datetime) -> CanaryAnalysisRow:
    """Start the analysis window of `route_revision`. `expected_revision` is the analysis
    row's revision the caller read (None: it read no row); a concurrent writer makes the flush
    raise StaleDataError (or IntegrityError for two inserts)."""
    row = session.get(CanaryAnalysisRow, adapter_id)
    if row is None:
        if expected_revision is not None:
            raise_stale(adapter_id)
        row = CanaryAnalysisRow(adapter_id=adapter_id, windows_passed=0, last_reason="",
                                last_details={})
        session.add(row)
    elif row.revision != expected_revision:
        raise_stale(adapter_id)
    row.canary_version, row.route_revision = canary, route_revision
    row.window_started_at, row.windows_passed = now, windows_passed
    return row


def record_decision(row: CanaryAnalysisRow, decision: str, version: str, reason: str,
                    details: dict[str, Any], now: dt.datetime) -> None:
    row.last_decision, row.last_version, row.last_decision_at = decision, version, now
    row.last_reason, row.last_details = reason, details


def raise_stale(adapter_id: str) -> NoReturn:
    raise StaleDataError(f"the canary analysis of {adapter_id} changed concurrently")
