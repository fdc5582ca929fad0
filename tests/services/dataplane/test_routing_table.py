"""The gateway's routing decisions: key check, tenant check, sticky canary split, fallback,
worker order."""

from __future__ import annotations

import pytest

from services.common import errors
from services.gateway.table import RoutingTable, token_sha256
from slora.v1 import admin_pb2
from slora.v1 import placement_pb2 as ppb

STABLE, CANARY = admin_pb2.VERSION_STATE_STABLE, admin_pb2.VERSION_STATE_CANARY


def table(ratio: float = 0.3) -> RoutingTable:
    t = RoutingTable()
    t.apply(ppb.RoutingUpdate(revision=1, snapshot=True, adapters=[ppb.RoutedAdapter(
        adapter_id="sql", tenant="acme", stable_version="v1", canary_version="v2",
        traffic_ratio=ratio, fallback_version="v0", versions=[
            ppb.RoutedVersion(version="v0", state=admin_pb2.VERSION_STATE_RETIRED),
            ppb.RoutedVersion(version="v1", state=STABLE, worker_ids=["w2"]),
            ppb.RoutedVersion(version="v2", state=CANARY, worker_ids=["w1"]),
            ppb.RoutedVersion(version="bad", state=admin_pb2.VERSION_STATE_FAILED),
        ])], workers=[
        ppb.WorkerEndpoint(worker_id="w1", address="a:1", up=True, load=0.9),
        ppb.WorkerEndpoint(worker_id="w2", address="a:2", up=True, load=0.1),
        ppb.WorkerEndpoint(worker_id="w3", address="a:3", up=True, load=0.0),
        ppb.WorkerEndpoint(worker_id="w4", address="a:4", up=False),
        ppb.WorkerEndpoint(worker_id="w5", address="a:5", up=True, draining=True),
    ], keys=[
        ppb.KeyGrant(token_sha256=token_sha256("acme-key"), key_id="k1", tenant="acme"),
        ppb.KeyGrant(token_sha256=token_sha256("other-key"), key_id="k2", tenant="other"),
        ppb.KeyGrant(token_sha256=token_sha256("admin-key"), key_id="k3", admin=True),
    ]))
    return t


def test_canary_split_is_30_percent_over_1000_keys_and_sticky():
    t = table(0.3)
    grant = t.authenticate("acme-key")
    first = {k: t.resolve(grant, "sql", None, f"user-{k}").version for k in range(1000)}
    share = sum(v == "v2" for v in first.values()) / 1000
    assert 0.26 <= share <= 0.34, share
    again = {k: t.resolve(grant, "sql", None, f"user-{k}").version for k in range(1000)}
    assert again == first
    # Raising the ratio only moves keys from stable to canary.
    t.adapters["sql"].traffic_ratio = 0.5
    raised = {k: t.resolve(grant, "sql", None, f"user-{k}").version for k in range(1000)}
    assert all(raised[k] == "v2" for k, v in first.items() if v == "v2")


def test_keys_and_tenants():
    t = table()
    with pytest.raises(errors.Unauthenticated):
        t.authenticate("")
    with pytest.raises(errors.Unauthenticated):
        t.authenticate("nope")
    with pytest.raises(errors.PermissionDenied):
        t.resolve(t.authenticate("other-key"), "sql", None, "k")
    assert t.resolve(t.authenticate("admin-key"), "sql", "v1", "k").version == "v1"
    with pytest.raises(errors.NotFound):
        t.resolve(t.authenticate("acme-key"), "missing", None, "k")
    t.apply(ppb.RoutingUpdate(revision=2, removed_keys=[token_sha256("acme-key")]))
    with pytest.raises(errors.Unauthenticated):
        t.authenticate("acme-key")


def test_explicit_versions_and_fallbacks():
    t = table()
    grant = t.authenticate("acme-key")
    explicit = t.resolve(grant, "sql", "v0", "k")
    assert (explicit.version, explicit.fallback) == ("v0", "")
    with pytest.raises(errors.NotFound):
        t.resolve(grant, "sql", "bad", "k")
    with pytest.raises(errors.NotFound):
        t.resolve(grant, "sql", "v9", "k")
    keys = [f"k{i}" for i in range(50)]
    routed = [t.resolve(grant, "sql", None, k) for k in keys]
    assert {(r.version, r.fallback) for r in routed} == {("v1", "v0"), ("v2", "v0")}
    t.adapters["sql"].fallback_version = ""
    canary = next(r for r in (t.resolve(grant, "sql", None, k) for k in keys) if r.version == "v2")
    assert canary.fallback == "v1"  # a canary that cannot load falls back to stable


def test_candidates_prefer_the_assignment_then_inflight_and_skip_down_or_draining():
    t = table()
    # The load a worker reports (w3: 0.0, w1: 0.9) orders nothing: it is the worker's claim.
    assert [w.worker_id for w in t.candidates("sql", "v2", {})] == ["w1", "w2", "w3"]
    assert [w.worker_id for w in t.candidates("sql", "v1", {"w2": 3})] == ["w2", "w1", "w3"]
    assert [w.worker_id for w in t.candidates("", "", {"w1": 2, "w2": 1})] == ["w3", "w2", "w1"]


def test_workers_marked_down_are_tried_only_when_none_is_up():
    t = table()
    for w in ("w1", "w2", "w3"):
        t.workers[w].up = False  # heartbeats late on a starved host; streams still open
    assert [w.worker_id for w in t.candidates("sql", "v1", {})] == ["w2", "w1", "w3", "w4"]
    t.workers["w3"].up = True
    assert [w.worker_id for w in t.candidates("sql", "v1", {})] == ["w3"]
    t.workers["w3"].draining = True  # draining ones never
    assert "w3" not in [w.worker_id for w in t.candidates("sql", "v1", {})]
