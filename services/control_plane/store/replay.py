"""Rebuilding every adapter's route and version states from the audit log alone.

Used to audit the registry: replaying the recorded actions, in order, through the lifecycle
rules must give exactly the stored routes, and each adapter's route changes must form an
unbroken chain of revisions (each change starts from the revision the previous one left), which
is what "no lost update" means.
"""

from __future__ import annotations

from collections.abc import Iterable

from services.control_plane.domain import lifecycle
from services.control_plane.domain.lifecycle import AdapterState
from services.control_plane.store.records import EventRecord

ROUTE_ACTIONS = ("canary", "promote", "rollback", "retire")
# Actions that advance the route's revision without changing the route (the policy shares the
# route's etag).
REVISION_ACTIONS = (*ROUTE_ACTIONS, "policy")


class ReplayError(Exception):
    """The audit log cannot have produced a consistent registry."""


def replay(events: Iterable[EventRecord]) -> dict[str, AdapterState]:
    """Adapter id -> the state the events lead to; events must be in id order."""
    states: dict[str, AdapterState] = {}
    revisions: dict[str, int] = {}
    for event in events:
        if event.adapter_id is None or event.action not in ("register", *REVISION_ACTIONS):
            continue
        adapter_id = event.adapter_id
        state = states.get(adapter_id, AdapterState())
        if event.action != "register":
            _check_chain(event, revisions.get(adapter_id, 1))
            revisions[adapter_id] = int(event.revision_after or 0)
        try:
            states[adapter_id] = _apply(state, event)
        except (lifecycle.IllegalTransition, lifecycle.UnknownVersion, ValueError) as e:
            raise ReplayError(f"event {event.id} ({event.action} {adapter_id}): {e}") from None
    return states


def _check_chain(event: EventRecord, expected_before: int) -> None:
    if event.revision_before != expected_before or event.revision_after != expected_before + 1:
        raise ReplayError(
            f"event {event.id} ({event.action} {event.adapter_id}) goes from revision "
            f"{event.revision_before} to {event.revision_after}; expected {expected_before} to "
            f"{expected_before + 1}"
        )


def _apply(state: AdapterState, event: EventRecord) -> AdapterState:
    version = event.version or ""
    if event.action == "register":
        return lifecycle.register(state, version)
    if event.action == "canary":
        return lifecycle.start_canary(state, version, float(event.details["args"]["traffic_ratio"]))
    if event.action == "promote":
        return lifecycle.promote(state, version)
    if event.action == "rollback":
        return lifecycle.rollback(state)
    if event.action == "policy":
        return state
    return lifecycle.retire(state, version)
