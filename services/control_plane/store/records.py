"""Plain, immutable records the registry hands out (no ORM objects, no protobuf types).

Servicers convert these to protobuf at the edge; other control-plane parts (placement, canary
analysis) can use them as they are.
"""

from __future__ import annotations

import datetime as dt
from dataclasses import dataclass, field
from typing import Any

from services.control_plane.domain.canary_policy import CanaryPolicy
from services.control_plane.domain.lifecycle import AdapterState, VersionState
from services.control_plane.store import models


def as_utc(value: dt.datetime) -> dt.datetime:
    """SQLite drops the zone of stored datetimes; every stored time is UTC."""
    return value if value.tzinfo is not None else value.replace(tzinfo=dt.UTC)


def etag_of(revision: int) -> str:
    """The etag clients see for a route revision. Opaque to clients; compared verbatim."""
    return f"r{revision}"


@dataclass(frozen=True)
class VersionRecord:
    adapter_id: str
    version: str
    state: VersionState
    rank: int
    lora_alpha: float
    use_rslora: bool
    target_modules: tuple[str, ...]
    num_bytes: int
    sha256: str
    storage_uri: str
    created_at: dt.datetime
    created_by: str
    labels: dict[str, str] = field(default_factory=dict)

    @classmethod
    def from_row(cls, row: models.AdapterVersion) -> VersionRecord:
        return cls(
            adapter_id=row.adapter_id,
            version=row.version,
            state=VersionState(row.state),
            rank=row.rank,
            lora_alpha=row.lora_alpha,
            use_rslora=row.use_rslora,
            target_modules=tuple(row.target_modules),
            num_bytes=row.num_bytes,
            sha256=row.sha256,
            storage_uri=row.storage_uri,
            created_at=as_utc(row.created_at),
            created_by=row.created_by,
            labels=dict(row.labels or {}),
        )


@dataclass(frozen=True)
class RouteRecord:
    stable_version: str | None
    canary_version: str | None
    traffic_ratio: float
    fallback_version: str | None
    revision: int
    updated_at: dt.datetime

    @property
    def etag(self) -> str:
        return etag_of(self.revision)

    @classmethod
    def from_row(cls, row: models.Route) -> RouteRecord:
        return cls(
            stable_version=row.stable_version,
            canary_version=row.canary_version,
            traffic_ratio=row.traffic_ratio,
            fallback_version=row.fallback_version,
            revision=row.revision,
            updated_at=as_utc(row.updated_at),
        )


@dataclass(frozen=True)
class AdapterRecord:
    adapter_id: str
    tenant: str
    base_model: str
    created_at: dt.datetime
    created_by: str
    route: RouteRecord
    versions: tuple[VersionRecord, ...]
    policy: CanaryPolicy | None = None

    @classmethod
    def from_row(cls, row: models.Adapter) -> AdapterRecord:
        return cls(
            adapter_id=row.adapter_id,
            tenant=row.tenant,
            base_model=row.base_model,
            created_at=as_utc(row.created_at),
            created_by=row.created_by,
            route=RouteRecord.from_row(row.route),
            versions=tuple(VersionRecord.from_row(v) for v in row.versions),
            policy=policy_of(row.policy),
        )

    def state(self) -> AdapterState:
        """The route and version states as a lifecycle value."""
        return state_of(self.route, {v.version: v.state for v in self.versions})


def policy_of(row: models.CanaryPolicyRow | None) -> CanaryPolicy | None:
    if row is None:
        return None
    return CanaryPolicy(
        window_s=row.window_s, min_requests=row.min_requests, min_feedback=row.min_feedback,
        max_error_rate_increase=row.max_error_rate_increase, max_ttft_ratio=row.max_ttft_ratio,
        max_tpot_ratio=row.max_tpot_ratio, max_feedback_drop=row.max_feedback_drop,
        steps=tuple(row.steps or ()),
    )


def state_of(route: RouteRecord | models.Route, states: dict[str, VersionState]) -> AdapterState:
    return AdapterState(
        stable=route.stable_version,
        canary=route.canary_version,
        traffic_ratio=route.traffic_ratio,
        fallback=route.fallback_version,
        states=states,
    )


@dataclass(frozen=True)
class EventRecord:
    id: int
    at: dt.datetime
    actor: str
    action: str
    tenant: str | None
    adapter_id: str | None
    version: str | None
    reason: str
    details: dict[str, Any]
    revision_before: int | None
    revision_after: int | None

    @classmethod
    def from_row(cls, row: models.AuditEvent) -> EventRecord:
        return cls(
            id=row.id,
            at=as_utc(row.at),
            actor=row.actor,
            action=row.action,
            tenant=row.tenant,
            adapter_id=row.adapter_id,
            version=row.version,
            reason=row.reason,
            details=dict(row.details or {}),
            revision_before=row.revision_before,
            revision_after=row.revision_after,
        )


@dataclass(frozen=True)
class TenantRecord:
    name: str
    created_at: dt.datetime
    created_by: str

    @classmethod
    def from_row(cls, row: models.Tenant) -> TenantRecord:
        return cls(row.name, as_utc(row.created_at), row.created_by)


@dataclass(frozen=True)
class KeyRecord:
    key_id: str
    scope: str
    tenant: str | None
    name: str
    created_at: dt.datetime
    created_by: str
    revoked_at: dt.datetime | None

    @classmethod
    def from_row(cls, row: models.ApiKey) -> KeyRecord:
        return cls(
            key_id=row.key_id,
            scope=row.scope,
            tenant=row.tenant,
            name=row.name,
            created_at=as_utc(row.created_at),
            created_by=row.created_by,
            revoked_at=as_utc(row.revoked_at) if row.revoked_at else None,
        )
