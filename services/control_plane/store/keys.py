"""Tenants and API keys: creation, revocation, and turning a bearer token into a principal.

A token is `slk_<key_id>_<secret>` with 32 random bytes of secret; the database keeps only the
sha256 of the whole token (a fast hash is enough for a secret of that entropy), so a leaked
database does not leak working keys.
"""

from __future__ import annotations

import hashlib
import secrets

from sqlalchemy import select
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session, sessionmaker

from services.common.errors import (
    AlreadyExists,
    InvalidArgument,
    NotFound,
    Unauthenticated,
)
from services.common.names import check_name, shown
from services.control_plane.domain.principal import ADMIN, SCOPES, SYSTEM, TENANT, Principal
from services.control_plane.store.audit import record_event
from services.control_plane.store.models import ApiKey, Tenant, utcnow
from services.control_plane.store.records import KeyRecord, TenantRecord

BOOTSTRAP_KEY_ID = "bootstrap"
MIN_BOOTSTRAP_TOKEN_CHARS = 16
MAX_KEY_NAME_CHARS = 256


def hash_token(token: str) -> str:
    return hashlib.sha256(token.encode("utf-8")).hexdigest()




class KeyStore:
    """Tenants and API keys over a SQLAlchemy session factory; every change leaves an audit
    event in the same transaction."""

    def __init__(self, sessions: sessionmaker[Session]) -> None:
        self._sessions = sessions

    def authenticate(self, token: str) -> Principal:
        """The principal of an active key with this token; Unauthenticated otherwise."""
        if not token:
            raise Unauthenticated("missing bearer token in the 'authorization' metadata")
        with self._sessions() as s:
            key = s.scalars(select(ApiKey).where(ApiKey.token_sha256 == hash_token(token))).first()
        if key is None or key.revoked_at is not None:
            raise Unauthenticated("unknown or revoked API key")
        return Principal(key_id=key.key_id, scope=key.scope, tenant=key.tenant)

    def ensure_bootstrap_key(self, token: str) -> KeyRecord:
        """Make `token` a working admin key (idempotent), so a fresh stack can be administered.

        An earlier bootstrap key with another token stops working: the configured token wins.
        """
        if len(token) < MIN_BOOTSTRAP_TOKEN_CHARS:
            raise InvalidArgument(f"the bootstrap admin key needs {MIN_BOOTSTRAP_TOKEN_CHARS}+ chars")
        digest = hash_token(token)
        with self._sessions.begin() as s:
            key = s.get(ApiKey, BOOTSTRAP_KEY_ID)
            if key is not None and key.token_sha256 == digest and key.revoked_at is None:
                return KeyRecord.from_row(key)
            if key is None:
                key = ApiKey(key_id=BOOTSTRAP_KEY_ID, scope=ADMIN, tenant=None,
                             name="bootstrap admin key", created_by=SYSTEM.actor)
                s.add(key)
            key.token_sha256, key.revoked_at = digest, None
            record_event(s, SYSTEM, "bootstrap_key", details={"key_id": BOOTSTRAP_KEY_ID})
        return KeyRecord.from_row(key)

    def create_tenant(self, name: str, actor: Principal) -> TenantRecord:
        actor.require_admin()
        check_name("tenant", name)
        try:
            with self._sessions.begin() as s:
                tenant = Tenant(name=name, created_by=actor.actor)
                s.add(tenant)
                s.flush()
                record_event(s, actor, "create_tenant", tenant=name)
        except IntegrityError:
            raise AlreadyExists(f"tenant {name!r} already exists") from None
        return TenantRecord.from_row(tenant)

    def list_tenants(self, viewer: Principal) -> list[TenantRecord]:
        with self._sessions() as s:
            query = select(Tenant).order_by(Tenant.name)
            if not viewer.is_admin:
                query = query.where(Tenant.name == viewer.tenant)
            return [TenantRecord.from_row(t) for t in s.scalars(query)]

    def create_key(
        self, scope: str, tenant: str | None, name: str, actor: Principal
    ) -> tuple[KeyRecord, str]:
        """A new key and its token; the token is not stored and cannot be shown again."""
        actor.require_admin()
        if scope not in SCOPES:
            raise InvalidArgument(f"scope must be one of {SCOPES}, got {shown(scope)}")
        if (scope == TENANT) != bool(tenant):
            raise InvalidArgument("tenant keys need a tenant; admin keys take none")
        if tenant:
            check_name("tenant", tenant)
        if len(name) > MAX_KEY_NAME_CHARS:
            raise InvalidArgument(f"key name is {len(name)} chars; at most {MAX_KEY_NAME_CHARS}")
        key_id = secrets.token_hex(8)
        token = f"slk_{key_id}_{secrets.token_urlsafe(32)}"
        with self._sessions.begin() as s:
            if tenant and s.get(Tenant, tenant) is None:
                raise NotFound(f"tenant {tenant!r} does not exist")
            key = ApiKey(key_id=key_id, token_sha256=hash_token(token), scope=scope,
                         tenant=tenant or None, name=name, created_by=actor.actor)
            s.add(key)
            record_event(s, actor, "create_key", tenant=tenant or None,
                         details={"key_id": key_id, "scope": scope, "name": name})
        return KeyRecord.from_row(key), token

    def list_keys(self, viewer: Principal, tenant: str | None = None) -> list[KeyRecord]:
        viewer.require_admin()
        with self._sessions() as s:
            query = select(ApiKey).order_by(ApiKey.created_at, ApiKey.key_id)
            if tenant:
                query = query.where(ApiKey.tenant == tenant)
            return [KeyRecord.from_row(k) for k in s.scalars(query)]

    def revoke_key(self, key_id: str, actor: Principal) -> KeyRecord:
        actor.require_admin()
        with self._sessions.begin() as s:
            key = s.get(ApiKey, key_id)
            if key is None:
                raise NotFound(f"API key {shown(key_id)} does not exist")
            if key.revoked_at is None:
                key.revoked_at = utcnow()
                record_event(s, actor, "revoke_key", tenant=key.tenant, details={"key_id": key_id})
        return KeyRecord.from_row(key)
