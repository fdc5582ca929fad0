"""The admin API against hostile names (issue 14), on SQLite and PostgreSQL: an adapter id
that climbs out of a folder, a megabyte-long id or version, and oversized free-text fields are
refused with INVALID_ARGUMENT, the message stays short, and the registry is left unchanged."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import grpc
import pytest

from services.control_plane.api.client import AdminClient
from slora.v1 import admin_pb2 as pb
from slora_core.adapters import digest_adapter_dir
from tests.services.control_plane.cp_support import ADMIN_TOKEN, BASE, RunningPlane, file_uri

BAD = grpc.StatusCode.INVALID_ARGUMENT
HUGE = "x" * 1_000_000
Call = Callable[[AdminClient, Path], object]


def _register(adapter_id: str = "sec/a", version: str = "v1", tenant: str = "acme",
              uri: str | None = None) -> Call:
    def call(admin: AdminClient, root: Path) -> object:
        good = root / "good" / "v1"
        return admin.register(adapter_id, version, uri or file_uri(good),
                              digest_adapter_dir(good), BASE, tenant)
    return call


CASES: dict[str, Call] = {
    "dotdot-in-adapter-id": _register(adapter_id="sec/../../../tmp/evil"),
    "dot-segment": _register(adapter_id="sec/./a"),
    "absolute-adapter-id": _register(adapter_id="/etc/passwd"),
    "backslash": _register(adapter_id="sec\\..\\a"),
    "megabyte-adapter-id": _register(adapter_id=HUGE),
    "megabyte-version": _register(version=HUGE),
    "dotdot-version": _register(version="../v1"),
    "megabyte-tenant": _register(tenant=HUGE),
    "megabyte-storage-uri": _register(uri="file:///" + HUGE),
    "get-megabyte-id": lambda admin, _root: admin.get(HUGE),
    "promote-megabyte-id": lambda admin, _root: admin.call(
        "Promote", pb.PromoteRequest(adapter_id=HUGE, version="v1", etag="1")),
    "promote-megabyte-etag": lambda admin, _root: admin.call(
        "Promote", pb.PromoteRequest(adapter_id="sec/a", version="v1", etag=HUGE)),
    "tenant-with-slash": lambda admin, _root: admin.call(
        "CreateTenant", pb.CreateTenantRequest(name="a/../b")),
    "list-events-megabyte-id": lambda admin, _root: admin.call(
        "ListEvents", pb.ListEventsRequest(adapter_id=HUGE)),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_hostile_names_are_refused(plane: RunningPlane, adapter_root: Path, case: str) -> None:
    before = plane.dump()
    with pytest.raises(grpc.RpcError) as info:
        CASES[case](plane.admin, adapter_root)
    code, details = info.value.code(), info.value.details() or ""
    # sec/a is not registered: NOT_FOUND, without echoing the etag; the rest are bad names.
    assert code == (grpc.StatusCode.NOT_FOUND if case == "promote-megabyte-etag" else BAD), details
    assert 0 < len(details) < 500
    assert plane.dump() == before


def test_invalid_utf8_is_invalid_argument(plane: RunningPlane) -> None:
    """Bytes that do not decode (bad UTF-8 in adapter_id) answer INVALID_ARGUMENT, not UNKNOWN,
    after authentication, and leave the registry unchanged."""
    raw = pb.GetAdapterRequest(adapter_id="x").SerializeToString().replace(b"x", b"\xff")
    call = plane.channel.unary_unary("/slora.v1.AdapterAdminService/GetAdapter",
                                     request_serializer=lambda b: b,
                                     response_deserializer=pb.AdapterInfo.FromString)
    before = plane.dump()
    with pytest.raises(grpc.RpcError) as info:
        call(raw, metadata=(("authorization", f"Bearer {ADMIN_TOKEN}"),), timeout=10)
    assert info.value.code() == BAD and "UTF-8" in (info.value.details() or "")
    with pytest.raises(grpc.RpcError) as info:
        call(raw, timeout=10)  # no key: the key is checked first
    assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED
    assert plane.dump() == before
