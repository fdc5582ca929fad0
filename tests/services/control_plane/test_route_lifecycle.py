"""The pure version/route transitions (DESIGN section 4)."""

from __future__ import annotations

import pytest

from services.control_plane.domain import lifecycle as lc
from services.control_plane.domain.lifecycle import AdapterState, IllegalTransition, UnknownVersion
from services.control_plane.domain.lifecycle import VersionState as S


def registered(*versions: str) -> AdapterState:
    state = AdapterState()
    for v in versions:
        state = lc.register(state, v)
    return state


def test_full_rollout_and_rollbacks() -> None:
    st = lc.promote(registered("v1", "v2", "v3"), "v1")
    assert (st.stable, st.fallback, st.states["v1"]) == ("v1", None, S.STABLE)
    st = lc.start_canary(st, "v2", 0.1)
    assert (st.canary, st.traffic_ratio, st.states["v2"]) == ("v2", 0.1, S.CANARY)
    st = lc.start_canary(st, "v2", 0.5)  # ramp the running canary
    assert st.traffic_ratio == 0.5
    st = lc.promote(st, "v2")
    assert (st.stable, st.canary, st.traffic_ratio, st.fallback) == ("v2", None, 0.0, "v1")
    assert (st.states["v1"], st.states["v2"]) == (S.RETIRED, S.STABLE)
    st = lc.rollback(lc.start_canary(st, "v3", 0.2))  # a bad canary
    assert (st.stable, st.canary, st.states["v3"]) == ("v2", None, S.ROLLED_BACK)
    st = lc.rollback(st)  # a bad stable: back to the fallback
    assert (st.stable, st.fallback, st.states["v2"], st.states["v1"]) == (
        "v1", None, S.ROLLED_BACK, S.STABLE)
    with pytest.raises(IllegalTransition, match="no fallback"):
        lc.rollback(st)


def test_retire_rules() -> None:
    st = lc.promote(lc.promote(registered("v1", "v2", "v3"), "v1"), "v2")
    with pytest.raises(IllegalTransition, match="takes traffic"):
        lc.retire(st, "v2")
    st = lc.retire(st, "v1")  # the retired fallback leaves the route
    assert st.fallback is None and st.states["v1"] is S.RETIRED
    with pytest.raises(IllegalTransition, match="already retired"):
        lc.retire(st, "v1")
    st = lc.retire(st, "v3")
    with pytest.raises(IllegalTransition, match="retired"):
        lc.start_canary(st, "v3", 0.5)


@pytest.mark.parametrize(
    ("setup", "action", "message"),
    [
        (lambda: registered("v1", "v2"), lambda s: lc.start_canary(s, "v2", 0.5), "no stable"),
        (lambda: lc.promote(registered("v1", "v2", "v3"), "v1"),
         lambda s: lc.promote(lc.start_canary(s, "v2", 0.5), "v3"), "canary 'v2' is running"),
        (lambda: lc.promote(registered("v1", "v2", "v3"), "v1"),
         lambda s: lc.start_canary(lc.start_canary(s, "v2", 0.5), "v3", 0.1), "is running"),
        (lambda: lc.promote(registered("v1"), "v1"), lambda s: lc.promote(s, "v1"), "is stable"),
        (lambda: lc.promote(registered("v1", "v2"), "v1"),
         lambda s: lc.start_canary(lc.retire(s, "v2"), "v2", 0.5), "retired"),
        (lambda: registered("v1"), lambda s: lc.rollback(s), "no fallback"),
        (lambda: registered("v1"), lambda s: lc.register(s, "v1"), "already registered"),
    ],
)
def test_illegal_transitions(setup, action, message) -> None:  # type: ignore[no-untyped-def]
    before = setup()
    with pytest.raises(IllegalTransition, match=message):
        action(before)


def test_rolled_back_version_returns_only_on_request() -> None:
    st = lc.rollback(lc.start_canary(lc.promote(registered("v1", "v2"), "v1"), "v2", 0.5))
    assert st.states["v2"] is S.ROLLED_BACK and st.canary is None
    again = lc.start_canary(st, "v2", 0.05)
    assert (again.canary, again.states["v2"]) == ("v2", S.CANARY)
    promoted = lc.promote(st, "v2")
    assert (promoted.stable, promoted.fallback, promoted.states["v1"]) == ("v2", "v1", S.RETIRED)


def test_unknown_version_and_bad_ratio() -> None:
    st = lc.promote(registered("v1", "v2"), "v1")
    with pytest.raises(UnknownVersion):
        lc.promote(st, "v9")
    for ratio in (0.0, -0.1, 1.5):
        with pytest.raises(ValueError):
            lc.start_canary(st, "v2", ratio)


def test_states_are_immutable() -> None:
    st = registered("v1")
    with pytest.raises(TypeError):
        st.states["v1"] = S.STABLE  # type: ignore[index]
    assert lc.promote(st, "v1").states["v1"] is S.STABLE and st.states["v1"] is S.VALIDATED
