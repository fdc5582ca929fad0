"""Worker credentials: what makes a process a worker (docs/security.md has the trust model).

A credential is `slw_<secret>` with 32 random bytes of secret, minted for one worker id by an
operator (`slora worker-credential mint`, or `slora up` for its own workers). The database
keeps the sha256 of the token bound to the id; minting again rotates it (the old token stops
working), revoking ends it. The placement stream authenticates with it, and a worker may only
say hello under the id its credential is bound to, and, when the credential names a base model,
only with that model's config digest.
"""

from __future__ import annotations

import datetime as dt
import secrets
from dataclasses import dataclass

from sqlalchemy import select
from sqlalchemy.orm import Session, sessionmaker

from services.common.errors import InvalidArgument, NotFound, Unauthenticated
from services.common.names import check_name, check_worker_id, shown
from services.control_plane.domain.principal import SYSTEM, Principal
from services.control_plane.store.audit import record_event
from services.control_plane.store.keys import hash_token
from services.control_plane.store.models import WorkerCredential, utcnow

TOKEN_PREFIX = "slw_"
MIN_TOKEN_CHARS = 32


@dataclass(frozen=True)
class WorkerCredentialRecord:
    worker_id: str
    created_at: dt.datetime
    created_by: str
    revoked_at: dt.datetime | None
    base_model: str | None = None


@dataclass(frozen=True)
class WorkerBinding:
    """What an authenticated worker credential allows: one worker id, and one base model
    (None: any this control plane serves)."""

    worker_id: str
    base_model: str | None


def new_worker_token() -> str:
    return TOKEN_PREFIX + secrets.token_urlsafe(32)


class WorkerCredentials:
    """Worker credentials over a session factory; every change leaves an audit event."""

    def __init__(self, sessions: sessionmaker[Session]) -> None:
        self._sessions = sessions

    def mint(self, worker_id: str, actor: Principal, token: str | None = None,
             base_model: str | None = None) -> str:
        """Bind a new token (random, or `token` when provisioned from outside, 32+ chars) to
        `worker_id` and, when given, to `base_model` (a control plane's --base-model name),
        replacing any earlier one; returns the token (not stored, shown once)."""
        actor.require_admin()
        check_worker_id(worker_id)
        if base_model is not None:
            check_name("base_model", base_model)
        token = token or new_worker_token()
        if len(token) < MIN_TOKEN_CHARS:
            raise InvalidArgument(f"a worker credential needs {MIN_TOKEN_CHARS}+ chars")
        with self._sessions.begin() as s:
            row = s.get(WorkerCredential, worker_id)
            if row is None:
                row = WorkerCredential(worker_id=worker_id, created_by=actor.actor)
                s.add(row)
            row.token_sha256, row.revoked_at = hash_token(token), None
            row.created_at, row.created_by = utcnow(), actor.actor
            row.base_model = base_model
            record_event(s, actor, "mint_worker_credential",
                         details={"worker_id": worker_id, "base_model": base_model})
        return token

    def revoke(self, worker_id: str, actor: Principal) -> None:
        actor.require_admin()
        with self._sessions.begin() as s:
            row = s.get(WorkerCredential, check_worker_id(worker_id))
            if row is None:
                raise NotFound(f"worker {shown(worker_id)} has no credential")
            if row.revoked_at is None:
                row.revoked_at = utcnow()
                record_event(s, actor, "revoke_worker_credential",
                             details={"worker_id": worker_id})

    def list(self) -> list[WorkerCredentialRecord]:
        with self._sessions() as s:
            rows = s.scalars(select(WorkerCredential).order_by(WorkerCredential.worker_id))
            return [WorkerCredentialRecord(r.worker_id, r.created_at, r.created_by, r.revoked_at,
                                           r.base_model) for r in rows]

    def active_worker_ids(self) -> set[str]:
        with self._sessions() as s:
            return set(s.scalars(select(WorkerCredential.worker_id)
                                 .where(WorkerCredential.revoked_at.is_(None))))

    def authenticate(self, token: str) -> WorkerBinding:
        """The worker id and base model an active credential with this token is bound to;
        Unauthenticated otherwise (the cluster token, an API key or a revoked credential
        included)."""
        if not token:
            raise Unauthenticated("the placement stream needs this worker's credential "
                                  "(SLORA_WORKER_CREDENTIAL; `slora worker-credential mint`)")
        with self._sessions() as s:
            row = s.scalars(select(WorkerCredential)
                            .where(WorkerCredential.token_sha256 == hash_token(token))).first()
        if row is None or row.revoked_at is not None:
            raise Unauthenticated("unknown or revoked worker credential (the cluster token alone "
                                  "does not make a process a worker)")
        return WorkerBinding(row.worker_id, row.base_model)


def mint_with_database(db_url: str, worker_id: str, token: str | None = None,
                       base_model: str | None = None) -> str:
    """Mint a credential for `worker_id` straight in the registry at `db_url` (migrated), as the
    system: for `slora up` and `slora worker-credential`, which run where the database is."""
    from services.control_plane.store.db import make_engine, make_session_factory

    engine = make_engine(db_url)
    try:
        return WorkerCredentials(make_session_factory(engine)).mint(worker_id, SYSTEM, token,
                                                                    base_model)
    finally:
        engine.dispose()
