"""The adapter registry: verified publishing, route changes under an etag, reads, audit log.

A plain class over a SQLAlchemy session factory, free of gRPC, so that the admin servicer and
the later placement/routing services share it. Every change is one transaction that leaves an
audit event; every route change compares the caller's etag with the stored revision and then
updates with `WHERE revision = <read>` (the ORM's version counter), so two racing changes cannot
both win even if both read the same etag.
"""

from __future__ import annotations

import base64
import datetime as dt
from collections.abc import Callable, Mapping
from typing import Any

from sqlalchemy import exists, select
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session, sessionmaker
from sqlalchemy.orm.exc import StaleDataError

from services.common.errors import Aborted, InvalidArgument, NotFound
from services.common.names import MAX_NAME, check_adapter_id, check_name, check_version, shown
from services.control_plane.domain import lifecycle
from services.control_plane.domain.adapter_check import AdapterSummary
from services.control_plane.domain.canary_policy import CanaryPolicy
from services.control_plane.domain.lifecycle import AdapterState, VersionState
from services.control_plane.domain.principal import Principal
from services.control_plane.store.audit import record_event
from services.control_plane.store.models import Adapter, AdapterVersion, AuditEvent, Route, Tenant
from services.control_plane.store.publish import (
    RegisterRequest,
    check_request,
    existing_version,
    fetch_and_validate,
    insert_version,
)
from services.control_plane.store.records import (
    AdapterRecord,
    EventRecord,
    VersionRecord,
    etag_of,
    state_of,
)
from services.control_plane.store.rollout_rows import write_policy
from services.control_plane.store.storage import StorageConfig
from slora_core.config import ModelConfig

DEFAULT_PAGE_SIZE, MAX_PAGE_SIZE = 50, 500
MAX_REASON_CHARS = 1024
COMMIT_ATTEMPTS = 3
Transition = Callable[[AdapterState], AdapterState]
# Runs inside a route change's transaction, after the route and versions were written, with the
# route's new revision; returns more audit details. Lets policy changes and the canary analyzer
# write their own rows atomically with the route under the same etag.
ChangeHook = Callable[[Session, Adapter, int], dict[str, Any]]


class Registry:
    """Adapters, versions, routes and the audit log of one control plane.

    `base_models` maps the names clients use to the configs adapters are validated against;
    `max_rank` is the engine's rank limit.
    """

    def __init__(
        self,
        sessions: sessionmaker[Session],
        base_models: Mapping[str, ModelConfig],
        storage: StorageConfig,
        max_rank: int,
    ) -> None:
        self._sessions = sessions
        self._base_models = dict(base_models)
        self._storage = storage
        self._max_rank = max_rank

    @property
    def base_models(self) -> Mapping[str, ModelConfig]:
        return self._base_models

    # -- publishing ---------------------------------------------------------------------------

    def register_version(self, req: RegisterRequest, actor: Principal) -> VersionRecord:
        """Fetch, verify and record a version as VALIDATED; see `publish`.

        Idempotent: the same (adapter, version, sha256) returns the stored record unchanged.
        """
        actor.require_admin()
        check_request(req, self._base_models)
        with self._sessions() as s:
            if s.get(Tenant, req.tenant) is None:
                raise NotFound(f"tenant {req.tenant!r} does not exist")
            found = existing_version(s, req)
            if found is not None:
                return VersionRecord.from_row(found)
        adapter = fetch_and_validate(req, self._base_models[req.base_model], self._storage,
                                     self._max_rank)
        return self._commit_version(req, adapter, actor)

    def _commit_version(self, req: RegisterRequest, adapter: AdapterSummary,
                        actor: Principal) -> VersionRecord:
        # A unique-key clash means a concurrent registration committed first: the adapter row
        # (then simply retry: it exists now) or this very version (then it is a no-op, or a
        # conflict that existing_version reports).
        for _ in range(COMMIT_ATTEMPTS):
            try:
                with self._sessions.begin() as s:
                    row = existing_version(s, req) or insert_version(s, req, adapter, actor)
                    return VersionRecord.from_row(row)
            except IntegrityError:
                continue
        raise Aborted(f"concurrent registrations of {req.adapter_id} kept colliding; retry")

    # -- route changes ------------------------------------------------------------------------

    def start_canary(self, adapter_id: str, version: str, ratio: float, etag: str,
                     actor: Principal, reason: str = "") -> AdapterRecord:
        if not 0.0 < ratio <= 1.0:
            raise InvalidArgument(f"traffic_ratio must lie in (0, 1], got {ratio}")
        return self.change_route(adapter_id, etag, actor, "canary", reason, version,
                                 lambda st: lifecycle.start_canary(st, version, ratio),
                                 {"traffic_ratio": ratio})

    def promote(self, adapter_id: str, version: str, etag: str, actor: Principal,
                reason: str = "") -> AdapterRecord:
        return self.change_route(adapter_id, etag, actor, "promote", reason, version,
                                 lambda st: lifecycle.promote(st, version))

    def rollback(self, adapter_id: str, etag: str, actor: Principal,
                 reason: str = "") -> AdapterRecord:
        return self.change_route(adapter_id, etag, actor, "rollback", reason, None,
                                 lifecycle.rollback)

    def retire(self, adapter_id: str, version: str, etag: str, actor: Principal,
               reason: str = "") -> AdapterRecord:
        return self.change_route(adapter_id, etag, actor, "retire", reason, version,
                                 lambda st: lifecycle.retire(st, version))

    def set_canary_policy(self, adapter_id: str, policy: CanaryPolicy | None, etag: str,
                          actor: Principal, reason: str = "") -> AdapterRecord:
        """Set (None: remove) the adapter's canary policy under the route's etag; the route's
        revision advances, so the analyzer opens a new window under the new policy."""
        def write(session: Session, adapter: Adapter, _revision: int) -> dict[str, Any]:
            return write_policy(session, adapter, policy, actor.actor)

        return self.change_route(adapter_id, etag, actor, "policy", reason, None,
                                 lambda st: st, hook=write)

    def change_route(self, adapter_id: str, etag: str, actor: Principal, action: str,
                     reason: str, version: str | None, transition: Transition,
                     args: dict[str, Any] | None = None,
                     hook: ChangeHook | None = None) -> AdapterRecord:
        """Apply `transition` to the adapter's route and versions in one transaction that
        checks `etag`, advances the route's revision and records an audit event `action`.
        Raises Aborted when the etag is stale or a concurrent change won."""
        actor.require_admin()
        check_adapter_id(adapter_id)
        if version is not None:
            check_version(version)
        if not etag:
            raise InvalidArgument("etag is required: read the adapter first and pass its etag")
        if len(reason) > MAX_REASON_CHARS:
            raise InvalidArgument(f"reason is {len(reason)} chars; at most {MAX_REASON_CHARS}")
        try:
            with self._sessions.begin() as s:
                # Lock the route row before reading anything else: under READ COMMITTED each
                # statement sees the latest commits, so versions read after the lock agree with
                # the route, and no other change can interleave until we commit.
                route = s.get(Route, adapter_id, with_for_update=True)
                if route is None:
                    raise NotFound(f"adapter {adapter_id!r} is not registered")
                adapter = route.adapter
                if etag != etag_of(route.revision):
                    raise Aborted(f"stale etag {shown(etag)}: {adapter_id} is now at "
                                  f"{etag_of(route.revision)}")
                rows = {v.version: v for v in adapter.versions}
                before = state_of(route, {name: VersionState(r.state) for name, r in rows.items()})
                after = transition(before)
                revision_before = route.revision
                route.stable_version, route.canary_version = after.stable, after.canary
                route.traffic_ratio, route.fallback_version = after.traffic_ratio, after.fallback
                route.updated_at = dt.datetime.now(dt.UTC)
                # Route first (`WHERE revision = <read>` as a second guard), then the versions and
                # the event, whose id is drawn while we hold the lock.
                s.flush()
                for name, state in after.states.items():
                    if rows[name].state != state:
                        rows[name].state = state
                details = {"args": args or {}, "before": before.route_dict(),
                           "after": after.route_dict()}
                if hook is not None:
                    details.update(hook(s, adapter, route.revision))
                record_event(
                    s, actor, action, tenant=adapter.tenant, adapter_id=adapter_id,
                    version=version, reason=reason, details=details,
                    revision_before=revision_before, revision_after=route.revision,
                )
                return AdapterRecord.from_row(adapter)
        except StaleDataError:
            raise Aborted(f"{adapter_id} was changed concurrently; read it again") from None

    # -- reads --------------------------------------------------------------------------------

    def get_adapter(self, adapter_id: str, viewer: Principal) -> AdapterRecord:
        check_adapter_id(adapter_id)
        with self._sessions() as s:
            adapter = self._load(s, adapter_id)
            viewer.check_tenant(adapter.tenant)
            return AdapterRecord.from_row(adapter)

    def list_adapters(
        self,
        viewer: Principal,
        *,
        tenant: str | None = None,
        state: VersionState | None = None,
        base_model: str | None = None,
        page_size: int = 0,
        page_token: str = "",
    ) -> tuple[list[AdapterRecord], str]:
        """One page of adapters ordered by id, and the token of the next page ('' at the end).
        A tenant key sees its own tenant only."""
        tenant = self._visible_tenant(viewer, tenant)
        if base_model and len(base_model) > MAX_NAME:
            raise InvalidArgument(f"base_model {shown(base_model)} is not a base model name")
        limit = _page_size(page_size)
        query = select(Adapter).order_by(Adapter.adapter_id).limit(limit + 1)
        if page_token:
            query = query.where(Adapter.adapter_id > _decode_token(page_token))
        if tenant:
            query = query.where(Adapter.tenant == tenant)
        if base_model:
            query = query.where(Adapter.base_model == base_model)
        if state is not None:
            query = query.where(exists().where(
                AdapterVersion.adapter_id == Adapter.adapter_id, AdapterVersion.state == state))
        with self._sessions() as s:
            rows = list(s.scalars(query).unique())
        page = [AdapterRecord.from_row(r) for r in rows[:limit]]
        more = len(rows) > limit
        return page, _encode_token(page[-1].adapter_id) if more else ""

    def list_events(
        self,
        viewer: Principal,
        *,
        adapter_id: str | None = None,
        tenant: str | None = None,
        page_size: int = 0,
        page_token: str = "",
    ) -> tuple[list[EventRecord], str]:
        """One page of audit events, oldest first; a tenant key sees its tenant's events only,
        and asking for another tenant's adapter gets the NotFound of an adapter that does not
        exist (an empty page would confirm it exists; a refusal naming the tenant would too)."""
        tenant = self._visible_tenant(viewer, tenant)
        if adapter_id:
            check_adapter_id(adapter_id)
            if not viewer.is_admin:
                with self._sessions() as s:
                    row = s.get(Adapter, adapter_id)
                    if row is None or row.tenant != viewer.tenant:
                        raise NotFound(f"adapter {adapter_id!r} is not registered")
        limit = _page_size(page_size)
        query = select(AuditEvent).order_by(AuditEvent.id).limit(limit + 1)
        if page_token:
            query = query.where(AuditEvent.id > _decode_int_token(page_token))
        if adapter_id:
            query = query.where(AuditEvent.adapter_id == adapter_id)
        if tenant:
            query = query.where(AuditEvent.tenant == tenant)
        with self._sessions() as s:
            rows = list(s.scalars(query))
        page = [EventRecord.from_row(r) for r in rows[:limit]]
        more = len(rows) > limit
        return page, _encode_token(str(page[-1].id)) if more else ""

    def _visible_tenant(self, viewer: Principal, tenant: str | None) -> str | None:
        if tenant:
            check_name("tenant", tenant)
        if viewer.is_admin:
            return tenant or None
        viewer.check_tenant(tenant or viewer.tenant)
        return viewer.tenant

    @staticmethod
    def _load(session: Session, adapter_id: str) -> Adapter:
        adapter = session.get(Adapter, adapter_id)
        if adapter is None:
            raise NotFound(f"adapter {adapter_id!r} is not registered")
        return adapter


def _page_size(requested: int) -> int:
    if requested < 0:
        raise InvalidArgument(f"page_size must not be negative, got {requested}")
    return min(requested or DEFAULT_PAGE_SIZE, MAX_PAGE_SIZE)


def _encode_token(value: str) -> str:
    return base64.urlsafe_b64encode(value.encode("utf-8")).decode("ascii")


def _decode_token(token: str) -> str:
    try:
        value = base64.b64decode(token.encode("ascii"), altchars=b"-_", validate=True).decode()
    except (ValueError, UnicodeError):
        raise InvalidArgument("malformed page_token") from None
    if not value:
        raise InvalidArgument("malformed page_token")
    return value


def _decode_int_token(token: str) -> int:
    value = _decode_token(token)
    if not value.isdigit():
        raise InvalidArgument("malformed page_token")
    return int(value)
