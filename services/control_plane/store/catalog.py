"""What placement and routing need from the registry, read in one go as plain values."""

from __future__ import annotations

from dataclasses import dataclass

from sqlalchemy import func, select
from sqlalchemy.orm import Session, sessionmaker

from services.control_plane.domain.lifecycle import VersionState
from services.control_plane.domain.principal import ADMIN
from services.control_plane.store.models import Adapter, ApiKey, AuditEvent

# Versions that can never be served: their files failed validation.
UNSERVABLE = (VersionState.REGISTERED, VersionState.FAILED)


@dataclass(frozen=True)
class CatalogVersion:
    version: str
    state: VersionState
    storage_uri: str
    sha256: str


@dataclass(frozen=True)
class CatalogAdapter:
    adapter_id: str
    tenant: str
    stable: str | None
    canary: str | None
    traffic_ratio: float
    fallback: str | None
    versions: tuple[CatalogVersion, ...]

    def routed_versions(self) -> list[str]:
        """Versions that take traffic now or may at once (fallback): keep these warm."""
        return [v for v in (self.stable, self.canary, self.fallback) if v]


@dataclass(frozen=True)
class CatalogKey:
    token_sha256: str
    key_id: str
    admin: bool
    tenant: str


@dataclass(frozen=True)
class Catalog:
    adapters: tuple[CatalogAdapter, ...] = ()
    keys: tuple[CatalogKey, ...] = ()


def fingerprint(sessions: sessionmaker[Session]) -> int:
    """Changes whenever the registry changed: every change leaves an audit event (one
    transaction), so the newest event id is enough and costs one indexed read."""
    with sessions() as s:
        return int(s.scalar(select(func.coalesce(func.max(AuditEvent.id), 0))) or 0)


def load_catalog(sessions: sessionmaker[Session]) -> Catalog:
    """Every adapter with its route and servable versions, and every active key."""
    with sessions() as s:
        adapters = tuple(_adapter(a) for a in s.scalars(select(Adapter).order_by(Adapter.adapter_id)).unique())
        keys = tuple(
            CatalogKey(k.token_sha256, k.key_id, k.scope == ADMIN, k.tenant or "")
            for k in s.scalars(select(ApiKey).where(ApiKey.revoked_at.is_(None)))
        )
    return Catalog(adapters, keys)


def _adapter(row: Adapter) -> CatalogAdapter:
    route = row.route
    versions = tuple(
        CatalogVersion(v.version, VersionState(v.state), v.storage_uri, v.sha256)
        for v in row.versions if VersionState(v.state) not in UNSERVABLE
    )
    return CatalogAdapter(
        adapter_id=row.adapter_id, tenant=row.tenant,
        stable=route.stable_version if route else None,
        canary=route.canary_version if route else None,
        traffic_ratio=route.traffic_ratio if route else 0.0,
        fallback=route.fallback_version if route else None,
        versions=versions,
    )
