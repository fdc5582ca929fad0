"""Writing audit events; every registry change calls this inside its own transaction."""

from __future__ import annotations

from typing import Any

from sqlalchemy.orm import Session

from services.control_plane.domain.principal import Principal
from services.control_plane.store.models import AuditEvent


def record_event(
    session: Session,
    actor: Principal,
    action: str,
    *,
    tenant: str | None = None,
    adapter_id: str | None = None,
    version: str | None = None,
    reason: str = "",
    details: dict[str, Any] | None = None,
    revision_before: int | None = None,
    revision_after: int | None = None,
) -> AuditEvent:
    """Insert one event and flush it, so that its id is drawn now: callers take the route's row
    lock first, which makes event ids rise in commit order for each adapter."""
    event = AuditEvent(
        actor=actor.actor,
        action=action,
        tenant=tenant,
        adapter_id=adapter_id,
        version=version,
        reason=reason,
        details=details or {},
        revision_before=revision_before,
        revision_after=revision_after,
    )
    session.add(event)
    session.flush()
    return event
