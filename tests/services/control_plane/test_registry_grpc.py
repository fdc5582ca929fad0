"""The admin API end to end over gRPC, on SQLite and PostgreSQL: verified publishing, the
rollout lifecycle with etags, reads, pagination and the audit log."""

from __future__ import annotations

import json
from pathlib import Path

import grpc
import pytest
import sqlalchemy as sa

from services.control_plane.api.client import AdminClient
from slora.v1 import admin_pb2 as pb
from slora_core.adapters import digest_adapter_dir, load_adapter
from slora_core.config import ModelConfig
from tests.services.control_plane.cp_support import BASE, MAX_RANK, RunningPlane, file_uri


def register(client: AdminClient, adapter_root: Path, adapter_id: str, version: str,
             source: str | None = None, **labels: str) -> pb.AdapterVersionInfo:
    path = adapter_root / "good" / (source or version)
    return client.register(adapter_id, version, file_uri(path), digest_adapter_dir(path), BASE,
                           "acme", labels)


def code_of(call: object) -> grpc.StatusCode:
    with pytest.raises(grpc.RpcError) as info:
        call()  # type: ignore[operator]
    return info.value.code()


def test_register_records_what_the_validator_saw(plane: RunningPlane, adapter_root: Path,
                                                 base_model_dir: Path) -> None:
    path = adapter_root / "good" / "v1"
    info = register(plane.admin, adapter_root, "reg/one", "v1", team="search")
    expected = load_adapter(path, ModelConfig.from_hf_dir(base_model_dir), max_rank=MAX_RANK)
    assert info.state == pb.VERSION_STATE_VALIDATED
    assert (info.rank, info.lora_alpha, info.use_rslora) == (4, 8.0, False)
    assert tuple(info.target_modules) == tuple(sorted(expected.target_modules))
    assert info.num_bytes == expected.num_bytes and info.sha256 == expected.sha256
    assert info.created_by == "key:bootstrap" and dict(info.labels) == {"team": "search"}
    adapter = plane.admin.get("reg/one")
    assert (adapter.tenant, adapter.base_model) == ("acme", BASE)
    assert adapter.route.stable_version == "" and adapter.route.etag


def test_same_version_and_sha_is_a_noop(plane: RunningPlane, adapter_root: Path) -> None:
    first = register(plane.admin, adapter_root, "reg/idem", "v1")
    before = plane.dump()
    again = register(plane.admin, adapter_root, "reg/idem", "v1")
    assert again == first
    assert plane.dump() == before


def test_same_version_other_sha_is_refused(plane: RunningPlane, adapter_root: Path) -> None:
    register(plane.admin, adapter_root, "reg/conflict", "v1")
    before = plane.dump()
    code = code_of(lambda: register(plane.admin, adapter_root, "reg/conflict", "v1", source="v2"))
    assert code == grpc.StatusCode.ALREADY_EXISTS
    assert plane.dump() == before


def test_rollout_lifecycle(plane: RunningPlane, adapter_root: Path) -> None:
    a, admin = "flow/main", plane.admin
    for v in ("v1", "v2", "v3"):
        register(admin, adapter_root, a, v)
    route = admin.promote(a, "v1", reason="first").route
    assert (route.stable_version, route.fallback_version) == ("v1", "")
    route = admin.canary(a, "v2", 0.1).route
    assert (route.canary_version, route.traffic_ratio) == ("v2", pytest.approx(0.1))
    info = admin.promote(a, "v2")
    assert (info.route.stable_version, info.route.canary_version, info.route.fallback_version) == (
        "v2", "", "v1")
    states = {v.version: v.state for v in info.versions}
    assert states == {"v1": pb.VERSION_STATE_RETIRED, "v2": pb.VERSION_STATE_STABLE,
                      "v3": pb.VERSION_STATE_VALIDATED}
    admin.canary(a, "v3", 0.5)
    info = admin.rollback(a, reason="canary error rate")
    assert info.route.stable_version == "v2" and info.route.canary_version == ""
    assert {v.version: v.state for v in info.versions}["v3"] == pb.VERSION_STATE_ROLLED_BACK
    info = admin.rollback(a, reason="bad stable")
    assert (info.route.stable_version, info.route.fallback_version) == ("v1", "")
    info = admin.retire(a, "v3")
    assert {v.version: v.state for v in info.versions} == {
        "v1": pb.VERSION_STATE_STABLE, "v2": pb.VERSION_STATE_ROLLED_BACK,
        "v3": pb.VERSION_STATE_RETIRED}
    events = admin.events(adapter_id=a)
    assert [e.action for e in events] == ["register"] * 3 + [
        "promote", "canary", "promote", "canary", "rollback", "rollback", "retire"]
    assert events[3].reason == "first" and events[-3].reason == "canary error rate"
    # Each route change starts from the etag the previous one left.
    changes = [e for e in events if e.action != "register"]
    for prev, cur in zip(changes, changes[1:], strict=False):
        assert cur.etag_before == prev.etag_after
    details = json.loads(events[4].details_json)
    assert details["args"] == {"traffic_ratio": 0.1}
    assert details["after"]["canary_version"] == "v2"


def test_stale_etag_is_aborted_and_changes_nothing(plane: RunningPlane, adapter_root: Path) -> None:
    a, admin = "flow/etag", plane.admin
    for v in ("v1", "v2"):
        register(admin, adapter_root, a, v)
    stale = admin.get(a).route.etag
    admin.promote(a, "v1", etag=stale)
    before = plane.dump()
    assert code_of(lambda: admin.canary(a, "v2", 0.2, etag=stale)) == grpc.StatusCode.ABORTED
    assert code_of(lambda: admin.rollback(a, "x", etag="r999")) == grpc.StatusCode.ABORTED
    assert plane.dump() == before


@pytest.mark.parametrize(
    ("call", "code"),
    [
        (lambda c: c.get("nope/missing"), grpc.StatusCode.NOT_FOUND),
        (lambda c: c.promote("flow/states", "v9"), grpc.StatusCode.NOT_FOUND),
        (lambda c: c.promote("flow/states", "v1", etag="garbage"), grpc.StatusCode.ABORTED),
        (lambda c: c.canary("flow/states", "v2", 0.5), grpc.StatusCode.FAILED_PRECONDITION),
        (lambda c: c.canary("flow/states", "v2", 1.5), grpc.StatusCode.INVALID_ARGUMENT),
        (lambda c: c.retire("flow/states", "v1"), grpc.StatusCode.OK),
        (lambda c: c.promote("flow/states", "v1"), grpc.StatusCode.FAILED_PRECONDITION),
        (lambda c: c.rollback("flow/states", "no fallback"), grpc.StatusCode.FAILED_PRECONDITION),
        (lambda c: c.call("ListAdapters", pb.ListAdaptersRequest(page_token="!!")),
         grpc.StatusCode.INVALID_ARGUMENT),
    ],
    ids=["unknown-adapter", "unknown-version", "bad-etag", "canary-without-stable",
         "ratio-out-of-range", "retire-validated", "promote-retired", "rollback-no-fallback",
         "bad-page-token"],
)
def test_illegal_requests(plane: RunningPlane, adapter_root: Path, call, code) -> None:  # type: ignore[no-untyped-def]
    a = "flow/states"
    try:
        plane.admin.get(a)
    except grpc.RpcError:
        for v in ("v1", "v2"):
            register(plane.admin, adapter_root, a, v)
    if code == grpc.StatusCode.OK:
        call(plane.admin)
        return
    before = plane.dump()
    assert code_of(lambda: call(plane.admin)) == code
    assert plane.dump() == before


def test_list_filters_and_pages(plane: RunningPlane, adapter_root: Path) -> None:
    admin = plane.admin
    admin.call("CreateTenant", pb.CreateTenantRequest(name="globex"))
    for i in range(5):
        admin.register(f"page/{i}", "v1", file_uri(adapter_root / "good" / "v1"),
                       digest_adapter_dir(adapter_root / "good" / "v1"), BASE,
                       "globex" if i % 2 else "acme")
    admin.promote("page/3", "v1")
    pages, token = [], ""
    while True:
        page = admin.call("ListAdapters", pb.ListAdaptersRequest(page_size=2, page_token=token))
        pages.append([a.adapter_id for a in page.adapters])
        token = page.next_page_token
        if not token:
            break
    ids = [x for p in pages for x in p]
    assert ids == sorted(ids) and len(ids) == len(set(ids)) and all(len(p) <= 2 for p in pages)
    assert {f"page/{i}" for i in range(5)} <= set(ids)
    globex = [a.adapter_id for a in admin.list_all(tenant="globex")]
    assert globex == ["page/1", "page/3"]
    stable = [a.adapter_id for a in admin.list_all(tenant="globex", state=pb.VERSION_STATE_STABLE)]
    assert stable == ["page/3"]
    assert [a.adapter_id for a in admin.list_all(base_model="other")] == []
    events = admin.events(tenant="globex")
    assert {e.adapter_id for e in events if e.adapter_id} == {"page/1", "page/3"}


def test_audit_log_is_append_only(plane: RunningPlane) -> None:
    from services.control_plane.store.models import AuditEvent

    with plane.sessions() as s:
        event = s.scalars(sa.select(AuditEvent).limit(1)).one()
        event.reason = "rewritten history"
        with pytest.raises(RuntimeError, match="append-only"):
            s.flush()
