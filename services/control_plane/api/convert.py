"""Conversions between registry records and `slora.v1` admin messages (the service edge)."""

from __future__ import annotations

import datetime as dt
import json

from google.protobuf.timestamp_pb2 import Timestamp

from services.common.errors import InvalidArgument
from services.control_plane.domain.canary_policy import CanaryPolicy
from services.control_plane.domain.lifecycle import VersionState
from services.control_plane.domain.principal import ADMIN, TENANT
from services.control_plane.rollout.rollout_status import RolloutStatus
from services.control_plane.store.records import (
    AdapterRecord,
    EventRecord,
    KeyRecord,
    TenantRecord,
    VersionRecord,
    etag_of,
)
from slora.v1 import admin_pb2 as pb

# Proto enum values are plain ints at run time; the generated stubs name them by enum class.
_STATE_TO_PB: dict[VersionState, pb.VersionState] = {
    state: pb.VersionState.Value(f"VERSION_STATE_{state.name}") for state in VersionState}
_PB_TO_STATE = {number: state for state, number in _STATE_TO_PB.items()}
_SCOPE_TO_PB: dict[str, pb.KeyScope] = {ADMIN: pb.KEY_SCOPE_ADMIN, TENANT: pb.KEY_SCOPE_TENANT}
_PB_TO_SCOPE = {number: scope for scope, number in _SCOPE_TO_PB.items()}


def timestamp(value: dt.datetime | None) -> Timestamp | None:
    if value is None:
        return None
    ts = Timestamp()
    ts.FromDatetime(value)
    return ts


def state_to_pb(state: VersionState) -> pb.VersionState:
    return _STATE_TO_PB[state]


def state_from_pb(number: pb.VersionState) -> VersionState | None:
    """None for UNSPECIFIED (no filter); InvalidArgument for numbers this server does not know."""
    if number == pb.VERSION_STATE_UNSPECIFIED:
        return None
    try:
        return _PB_TO_STATE[number]
    except KeyError:
        raise InvalidArgument(f"unknown version state {number}") from None


def scope_from_pb(number: pb.KeyScope) -> str:
    try:
        return _PB_TO_SCOPE[number]
    except KeyError:
        raise InvalidArgument("scope must be KEY_SCOPE_ADMIN or KEY_SCOPE_TENANT") from None


def version_to_pb(v: VersionRecord) -> pb.AdapterVersionInfo:
    return pb.AdapterVersionInfo(
        adapter_id=v.adapter_id, version=v.version, state=state_to_pb(v.state), rank=v.rank,
        lora_alpha=v.lora_alpha, use_rslora=v.use_rslora, target_modules=list(v.target_modules),
        num_bytes=v.num_bytes, sha256=v.sha256, storage_uri=v.storage_uri,
        created_at=timestamp(v.created_at), created_by=v.created_by, labels=v.labels,
    )


def adapter_to_pb(a: AdapterRecord) -> pb.AdapterInfo:
    r = a.route
    route = pb.AdapterRoute(
        stable_version=r.stable_version or "", canary_version=r.canary_version or "",
        traffic_ratio=r.traffic_ratio, fallback_version=r.fallback_version or "", etag=r.etag,
        updated_at=timestamp(r.updated_at),
    )
    return pb.AdapterInfo(
        adapter_id=a.adapter_id, tenant=a.tenant, base_model=a.base_model,
        created_at=timestamp(a.created_at), created_by=a.created_by, route=route,
        versions=[version_to_pb(v) for v in a.versions],
        canary_policy=policy_to_pb(a.policy) if a.policy else None,
    )


def policy_to_pb(p: CanaryPolicy) -> pb.CanaryPolicy:
    return pb.CanaryPolicy(
        window_seconds=p.window_s, min_requests=p.min_requests,
        max_error_rate_increase=p.max_error_rate_increase, max_ttft_ratio=p.max_ttft_ratio,
        max_tpot_ratio=p.max_tpot_ratio, max_feedback_drop=p.max_feedback_drop,
        min_feedback=p.min_feedback, steps=list(p.steps),
    )


def policy_from_pb(request: pb.SetCanaryPolicyRequest) -> CanaryPolicy | None:
    """None when the request carries no policy (remove it); InvalidArgument when invalid."""
    if not request.HasField("policy"):
        return None
    m = request.policy

    def opt(name: str) -> float | None:
        return getattr(m, name) if m.HasField(name) else None

    return CanaryPolicy(
        window_s=m.window_seconds, min_requests=m.min_requests,
        max_error_rate_increase=opt("max_error_rate_increase"),
        max_ttft_ratio=opt("max_ttft_ratio"), max_tpot_ratio=opt("max_tpot_ratio"),
        max_feedback_drop=opt("max_feedback_drop"), min_feedback=m.min_feedback or 1,
        steps=tuple(m.steps),
    )


def event_to_pb(e: EventRecord) -> pb.AuditEvent:
    return pb.AuditEvent(
        id=e.id, at=timestamp(e.at), actor=e.actor, action=e.action, tenant=e.tenant or "",
        adapter_id=e.adapter_id or "", version=e.version or "", reason=e.reason,
        details_json=json.dumps(e.details, sort_keys=True),
        etag_before=etag_of(e.revision_before) if e.revision_before else "",
        etag_after=etag_of(e.revision_after) if e.revision_after else "",
    )


def tenant_to_pb(t: TenantRecord) -> pb.TenantInfo:
    return pb.TenantInfo(name=t.name, created_at=timestamp(t.created_at), created_by=t.created_by)


def key_to_pb(k: KeyRecord) -> pb.ApiKeyInfo:
    return pb.ApiKeyInfo(
        key_id=k.key_id, scope=_SCOPE_TO_PB[k.scope], tenant=k.tenant or "", name=k.name,
        created_at=timestamp(k.created_at), created_by=k.created_by,
        revoked_at=timestamp(k.revoked_at),
    )


def rollout_status_to_pb(st: RolloutStatus) -> pb.RolloutStatus:
    figures = [
        pb.VersionFigures(version=f.version, state=state_to_pb(f.state), role=f.role,
                          window=f.window.to_pb() if f.window is not None else None,
                          total=f.total.to_pb())
        for f in st.figures
    ]
    return pb.RolloutStatus(adapter=adapter_to_pb(st.adapter), figures=figures,
                            analysis=_analysis_to_pb(st))


def _analysis_to_pb(st: RolloutStatus) -> pb.CanaryAnalysis | None:
    a, live, route = st.analysis, st.live, st.adapter.route
    if a is None and st.adapter.policy is None:
        return None
    out = pb.CanaryAnalysis(canary_version=route.canary_version or "")
    if live is not None:
        out.window_started_at.CopyFrom(timestamp(live.started_at))
        out.window_elapsed_seconds = live.elapsed_s
        out.waiting_for = live.waiting_for
    elif a is not None and route.canary_version and a.route_revision == route.revision:
        # The analyzer of this process has not looked yet (restart, another control plane).
        out.window_started_at.CopyFrom(timestamp(a.window_started_at))
        elapsed = dt.datetime.now(dt.UTC) - a.window_started_at
        out.window_elapsed_seconds = max(0.0, elapsed.total_seconds())
        out.waiting_for = "this control plane's analyzer to take over the window"
    elif route.canary_version:
        out.waiting_for = ("a canary policy" if st.adapter.policy is None
                           else "the analyzer to open a window")
    if a is None:
        return out
    if a.canary_version and a.canary_version == out.canary_version:
        out.windows_passed = a.windows_passed
    out.last_decision, out.last_version = a.last_decision or "", a.last_version or ""
    out.last_reason = a.last_reason
    out.last_details_json = json.dumps(a.last_details, sort_keys=True) if a.last_details else ""
    if a.last_decision_at is not None:
        out.last_decision_at.CopyFrom(timestamp(a.last_decision_at))
    return out
