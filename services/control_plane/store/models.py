"""The registry schema (SQLAlchemy 2, typed). Alembic migrations in `migrations/` create it;
`alembic check` compares them against these classes."""

from __future__ import annotations

import datetime as dt
from typing import Any

from sqlalchemy import (
    JSON,
    BigInteger,
    CheckConstraint,
    DateTime,
    Enum,
    Float,
    ForeignKey,
    Index,
    Integer,
    MetaData,
    String,
    Text,
    UniqueConstraint,
)
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column, relationship

from services.control_plane.domain.lifecycle import VersionState

# Stable constraint names, so that migrations on SQLite (batch mode) and PostgreSQL agree.
NAMING_CONVENTION = {
    "ix": "ix_%(column_0_label)s",
    "uq": "uq_%(table_name)s_%(column_0_name)s",
    "ck": "ck_%(table_name)s_%(constraint_name)s",
    "fk": "fk_%(table_name)s_%(column_0_name)s_%(referred_table_name)s",
    "pk": "pk_%(table_name)s",
}

ID_LENGTH = 128
# BigInteger ids that still autoincrement on SQLite, where only INTEGER PRIMARY KEY does.
BigId = BigInteger().with_variant(Integer(), "sqlite")


def utcnow() -> dt.datetime:
    return dt.datetime.now(dt.UTC)


class Base(DeclarativeBase):
    metadata = MetaData(naming_convention=NAMING_CONVENTION)


class Tenant(Base):
    __tablename__ = "tenants"

    name: Mapped[str] = mapped_column(String(ID_LENGTH), primary_key=True)
    created_at: Mapped[dt.datetime] = mapped_column(DateTime(timezone=True), default=utcnow)
    created_by: Mapped[str] = mapped_column(String(ID_LENGTH))


class ApiKey(Base):
    """An API key; only the sha256 of its token is stored."""

    __tablename__ = "api_keys"
    __table_args__ = (
        CheckConstraint("scope IN ('admin', 'tenant')", name="scope"),
        CheckConstraint("(scope = 'admin') = (tenant IS NULL)", name="tenant_iff_tenant_scope"),
    )

    key_id: Mapped[str] = mapped_column(String(64), primary_key=True)
    token_sha256: Mapped[str] = mapped_column(String(64), unique=True)
    scope: Mapped[str] = mapped_column(String(16))
    tenant: Mapped[str | None] = mapped_column(ForeignKey("tenants.name"), index=True)
    name: Mapped[str] = mapped_column(String(ID_LENGTH), default="")
    created_at: Mapped[dt.datetime] = mapped_column(DateTime(timezone=True), default=utcnow)
    created_by: Mapped[str] = mapped_column(String(ID_LENGTH))
    revoked_at: Mapped[dt.datetime | None] = mapped_column(DateTime(timezone=True))


class WorkerCredential(Base):
    """A worker's own credential, bound to its worker id (one active token per id; minting
    again rotates it). Only the sha256 of the token is stored."""

    __tablename__ = "worker_credentials"

    worker_id: Mapped[str] = mapped_column(String(ID_LENGTH), primary_key=True)
    token_sha256: Mapped[str] = mapped_column(String(64), unique=True)
    created_at: Mapped[dt.datetime] = mapped_column(DateTime(timezone=True), default=utcnow)
    created_by: Mapped[str] = mapped_column(String(ID_LENGTH))
    revoked_at: Mapped[dt.datetime | None] = mapped_column(DateTime(timezone=True))
    # The base model (a control plane's --base-model name) the worker must serve: its hello
    # must carry that model's config digest. None: any base model this control plane serves.
    base_model: Mapped[str | None] = mapped_column(String(ID_LENGTH))


class Adapter(Base):
    __tablename__ = "adapters"

    adapter_id: Mapped[str] = mapped_column(String(ID_LENGTH), primary_key=True)
    tenant: Mapped[str] = mapped_column(ForeignKey("tenants.name"), index=True)
    base_model: Mapped[str] = mapped_column(String(ID_LENGTH))
    created_at: Mapped[dt.datetime] = mapped_column(DateTime(timezone=True), default=utcnow)
    created_by: Mapped[str] = mapped_column(String(ID_LENGTH))

    route: Mapped[Route] = relationship(back_populates="adapter", lazy="joined")
    # Joined loads: an adapter, its route and versions come from one SELECT, hence one snapshot
    # even under READ COMMITTED.
    versions: Mapped[list[AdapterVersion]] = relationship(
        back_populates="adapter", order_by="AdapterVersion.id", lazy="joined"
    )
    policy: Mapped[CanaryPolicyRow | None] = relationship(lazy="joined")


class AdapterVersion(Base):
    __tablename__ = "adapter_versions"
    __table_args__ = (
        UniqueConstraint("adapter_id", "version", name="uq_adapter_versions_adapter_version"),
    )

    id: Mapped[int] = mapped_column(BigId, primary_key=True, autoincrement=True)
    adapter_id: Mapped[str] = mapped_column(ForeignKey("adapters.adapter_id"))
    version: Mapped[str] = mapped_column(String(64))
    state: Mapped[VersionState] = mapped_column(
        Enum(
            VersionState,
            name="version_state",
            native_enum=False,
            create_constraint=True,
            length=16,
            values_callable=lambda e: [m.value for m in e],
            validate_strings=True,
        )
    )
    rank: Mapped[int] = mapped_column(Integer)
    lora_alpha: Mapped[float] = mapped_column(Float)
    use_rslora: Mapped[bool] = mapped_column(default=False)
    target_modules: Mapped[list[str]] = mapped_column(JSON)
    num_bytes: Mapped[int] = mapped_column(BigInteger)
    sha256: Mapped[str] = mapped_column(String(64))
    storage_uri: Mapped[str] = mapped_column(Text)
    labels: Mapped[dict[str, str]] = mapped_column(JSON, default=dict)
    created_at: Mapped[dt.datetime] = mapped_column(DateTime(timezone=True), default=utcnow)
    created_by: Mapped[str] = mapped_column(String(ID_LENGTH))

    adapter: Mapped[Adapter] = relationship(back_populates="versions")


class Route(Base):
    """Where an adapter's traffic goes. `revision` rises by one with every change; the etag
    handed to clients is derived from it and compared-and-swapped on update."""

    __tablename__ = "routes"
    __table_args__ = (
        CheckConstraint("traffic_ratio >= 0 AND traffic_ratio <= 1", name="traffic_ratio"),
    )

    adapter_id: Mapped[str] = mapped_column(ForeignKey("adapters.adapter_id"), primary_key=True)
    stable_version: Mapped[str | None] = mapped_column(String(64))
    canary_version: Mapped[str | None] = mapped_column(String(64))
    traffic_ratio: Mapped[float] = mapped_column(Float, default=0.0)
    fallback_version: Mapped[str | None] = mapped_column(String(64))
    revision: Mapped[int] = mapped_column(BigInteger, default=1)
    updated_at: Mapped[dt.datetime] = mapped_column(DateTime(timezone=True), default=utcnow)

    adapter: Mapped[Adapter] = relationship(back_populates="route")

    # The ORM adds `WHERE revision = <read value>` to every UPDATE and raises StaleDataError
    # when no row matched: the database-side half of the etag compare-and-swap.
    __mapper_args__ = {"version_id_col": revision}


class AuditEvent(Base):
    """Append-only: the registry only ever inserts rows here (see `db.forbid_audit_changes`)."""

    __tablename__ = "audit_events"
    __table_args__ = (Index("ix_audit_events_adapter_id_id", "adapter_id", "id"),)

    id: Mapped[int] = mapped_column(BigId, primary_key=True, autoincrement=True)
    at: Mapped[dt.datetime] = mapped_column(DateTime(timezone=True), default=utcnow)
    actor: Mapped[str] = mapped_column(String(ID_LENGTH))
    action: Mapped[str] = mapped_column(String(32))
    tenant: Mapped[str | None] = mapped_column(String(ID_LENGTH), index=True)
    adapter_id: Mapped[str | None] = mapped_column(String(ID_LENGTH))
    version: Mapped[str | None] = mapped_column(String(64))
    reason: Mapped[str] = mapped_column(Text, default="")
    details: Mapped[dict[str, Any]] = mapped_column(JSON, default=dict)
    revision_before: Mapped[int | None] = mapped_column(BigInteger)
    revision_after: Mapped[int | None] = mapped_column(BigInteger)


class CanaryPolicyRow(Base):
    """An adapter's canary policy (see canary_policy.CanaryPolicy). Changed only together with
    the route (`Registry.set_canary_policy`), so the route's etag covers it."""

    __tablename__ = "canary_policies"

    adapter_id: Mapped[str] = mapped_column(ForeignKey("adapters.adapter_id"), primary_key=True)
    window_s: Mapped[float] = mapped_column(Float)
    min_requests: Mapped[int] = mapped_column(Integer)
    min_feedback: Mapped[int] = mapped_column(Integer, default=1)
    max_error_rate_increase: Mapped[float | None] = mapped_column(Float)
    max_ttft_ratio: Mapped[float | None] = mapped_column(Float)
    max_tpot_ratio: Mapped[float | None] = mapped_column(Float)
    max_feedback_drop: Mapped[float | None] = mapped_column(Float)
    steps: Mapped[list[float]] = mapped_column(JSON, default=list)
    updated_at: Mapped[dt.datetime] = mapped_column(DateTime(timezone=True), default=utcnow)
    updated_by: Mapped[str] = mapped_column(String(ID_LENGTH))


class CanaryAnalysisRow(Base):
    """The analyzer's state for one adapter, so that its windows and decisions survive a
    control-plane restart. A window belongs to one route revision: any route change (a
    decision, an admin call, a policy change) opens a new one. `revision` is compared and
    swapped on every update, so two control planes cannot both record a window's outcome."""

    __tablename__ = "canary_analyses"

    adapter_id: Mapped[str] = mapped_column(ForeignKey("adapters.adapter_id"), primary_key=True)
    canary_version: Mapped[str | None] = mapped_column(String(64))
    route_revision: Mapped[int] = mapped_column(BigInteger)
    window_started_at: Mapped[dt.datetime] = mapped_column(DateTime(timezone=True))
    windows_passed: Mapped[int] = mapped_column(Integer, default=0)
    last_decision: Mapped[str | None] = mapped_column(String(16))
    last_version: Mapped[str | None] = mapped_column(String(64))
    last_decision_at: Mapped[dt.datetime | None] = mapped_column(DateTime(timezone=True))
    last_reason: Mapped[str] = mapped_column(Text, default="")
    last_details: Mapped[dict[str, Any]] = mapped_column(JSON, default=dict)
    revision: Mapped[int] = mapped_column(BigInteger, default=1)

    __mapper_args__ = {"version_id_col": revision}


class CanaryEvidenceRow(Base):
    """The evidence of one version within one analysis window (adapter, route revision),
    accumulated by the analyzer each tick, so a restarted control plane resumes the window with
    what it had seen instead of counting from zero (`store/evidence_rows.py`)."""

    __tablename__ = "canary_evidence"

    adapter_id: Mapped[str] = mapped_column(ForeignKey("adapters.adapter_id"), primary_key=True)
    route_revision: Mapped[int] = mapped_column(BigInteger, primary_key=True)
    version: Mapped[str] = mapped_column(String(64), primary_key=True)
    evidence: Mapped[dict[str, Any]] = mapped_column(JSON, default=dict)
    updated_at: Mapped[dt.datetime] = mapped_column(DateTime(timezone=True), default=utcnow)


class EvidenceCheckpointRow(Base):
    """A worker's cumulative counters as of the evidence last written to `canary_evidence`:
    a restarted control plane takes the worker's next heartbeat as news from there, not as a
    baseline, so what the worker counted meanwhile is not lost."""

    __tablename__ = "evidence_checkpoints"

    worker_id: Mapped[str] = mapped_column(String(ID_LENGTH), primary_key=True)
    started_at_ms: Mapped[int] = mapped_column(BigInteger)
    counters: Mapped[list[Any]] = mapped_column(JSON, default=list)
