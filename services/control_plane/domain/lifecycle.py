"""Version states and the route of one adapter, as pure values and pure transitions.

The registry loads an `AdapterState` from the database, applies one transition and writes the
difference back in the same transaction. Keeping the rules here, free of SQL, lets the tests
replay the audit log through the very same functions and compare with the stored routes.

Rules (DESIGN section 4):
- register: a new version enters VALIDATED (it is validated before it is committed).
- start_canary(v, ratio): v is VALIDATED (or ROLLED_BACK: only an explicit call brings a
  rolled-back version back), a stable version exists, no other canary runs; the same running
  canary may change its ratio.
- promote(v): v is the running canary, or VALIDATED/ROLLED_BACK while no canary runs. The old
  stable becomes RETIRED and is kept as the fallback.
- rollback: a running canary becomes ROLLED_BACK; otherwise the stable version becomes
  ROLLED_BACK and the fallback takes its place. With neither, it is refused.
- retire(v): v takes no traffic (not stable, not canary); a retired fallback leaves the route.
  RETIRED is final for traffic: to serve the same files again, register them as a new version.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from types import MappingProxyType


class VersionState(enum.StrEnum):
    REGISTERED = "registered"
    VALIDATED = "validated"
    CANARY = "canary"
    STABLE = "stable"
    RETIRED = "retired"
    FAILED = "failed"
    ROLLED_BACK = "rolled_back"


# States a version may leave for canary or stable on an explicit request.
READY = (VersionState.VALIDATED, VersionState.ROLLED_BACK)


class IllegalTransition(Exception):
    """The requested change is not allowed from the adapter's current state."""


class UnknownVersion(Exception):
    """The transition names a version the adapter does not have."""


def _frozen(states: Mapping[str, VersionState]) -> Mapping[str, VersionState]:
    return MappingProxyType(dict(states))


@dataclass(frozen=True)
class AdapterState:
    """Route and version states of one adapter; every transition returns a new value."""

    stable: str | None = None
    canary: str | None = None
    traffic_ratio: float = 0.0
    fallback: str | None = None
    states: Mapping[str, VersionState] = field(default_factory=lambda: _frozen({}))

    def state_of(self, version: str) -> VersionState:
        try:
            return self.states[version]
        except KeyError:
            raise UnknownVersion(f"version {version!r} is not registered") from None

    def route_dict(self) -> dict[str, object]:
        """The route as plain JSON-able values (audit details, comparisons)."""
        return {
            "stable_version": self.stable,
            "canary_version": self.canary,
            "traffic_ratio": self.traffic_ratio,
            "fallback_version": self.fallback,
        }

    def _with(self, states: dict[str, VersionState] | None = None, **route: object) -> AdapterState:
        merged = dict(self.states)
        merged.update(states or {})
        return replace(self, states=_frozen(merged), **route)  # type: ignore[arg-type]


def register(state: AdapterState, version: str) -> AdapterState:
    if version in state.states:
        raise IllegalTransition(f"version {version!r} is already registered")
    return state._with({version: VersionState.VALIDATED})


def start_canary(state: AdapterState, version: str, ratio: float) -> AdapterState:
    if not 0.0 < ratio <= 1.0:
        raise ValueError(f"traffic_ratio must lie in (0, 1], got {ratio}")
    current = state.state_of(version)
    if state.canary == version:
        return state._with(traffic_ratio=ratio)
    if state.canary is not None:
        raise IllegalTransition(
            f"canary {state.canary!r} is running; promote or roll it back before starting {version!r}"
        )
    if state.stable is None:
        raise IllegalTransition("no stable version to split traffic with; promote a version first")
    if current not in READY:
        raise IllegalTransition(
            f"version {version!r} is {current}; only validated or rolled-back versions can canary"
        )
    return state._with({version: VersionState.CANARY}, canary=version, traffic_ratio=ratio)


def promote(state: AdapterState, version: str) -> AdapterState:
    current = state.state_of(version)
    if state.canary is not None and state.canary != version:
        raise IllegalTransition(
            f"canary {state.canary!r} is running; promote it or roll it back before promoting {version!r}"
        )
    if current not in (*READY, VersionState.CANARY):
        raise IllegalTransition(
            f"version {version!r} is {current}; only the canary or a validated or rolled-back "
            "version can be promoted"
        )
    changes = {version: VersionState.STABLE}
    fallback = state.fallback
    if state.stable is not None:
        changes[state.stable] = VersionState.RETIRED
        fallback = state.stable
    return state._with(changes, stable=version, canary=None, traffic_ratio=0.0, fallback=fallback)


def rollback(state: AdapterState) -> AdapterState:
    if state.canary is not None:
        return state._with(
            {state.canary: VersionState.ROLLED_BACK}, canary=None, traffic_ratio=0.0
        )
    if state.stable is None or state.fallback is None:
        raise IllegalTransition("no canary is running and there is no fallback version to roll back to")
    return state._with(
        {state.stable: VersionState.ROLLED_BACK, state.fallback: VersionState.STABLE},
        stable=state.fallback,
        fallback=None,
    )


def retire(state: AdapterState, version: str) -> AdapterState:
    current = state.state_of(version)
    if version in (state.stable, state.canary):
        raise IllegalTransition(
            f"version {version!r} takes traffic ({current}); promote another version or roll back first"
        )
    if current is VersionState.RETIRED and state.fallback != version:
        raise IllegalTransition(f"version {version!r} is already retired")
    fallback = None if state.fallback == version else state.fallback
    return state._with({version: VersionState.RETIRED}, fallback=fallback)
