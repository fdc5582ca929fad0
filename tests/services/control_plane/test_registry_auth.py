"""API keys over gRPC: bearer tokens checked by the interceptor, admin and tenant scopes,
revocation, the bootstrap key; health and reflection stay open."""

from __future__ import annotations

from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from services.control_plane.store.keys import hash_token
from services.control_plane.store.models import ApiKey
from slora.v1 import admin_pb2 as pb
from slora_core.adapters import digest_adapter_dir
from tests.services.control_plane.cp_support import ADMIN_TOKEN, BASE, RunningPlane, file_uri

UNAUTHENTICATED = grpc.StatusCode.UNAUTHENTICATED
DENIED = grpc.StatusCode.PERMISSION_DENIED


def code_of(fn) -> grpc.StatusCode:  # type: ignore[no-untyped-def]
    with pytest.raises(grpc.RpcError) as info:
        fn()
    return info.value.code()


@pytest.fixture(scope="module")
def tenants(plane: RunningPlane, adapter_root: Path) -> dict[str, str]:
    """Tenants acme (adapter auth/acme) and umbrella (adapter auth/umbrella), a tenant key each."""
    admin = plane.admin
    admin.call("CreateTenant", pb.CreateTenantRequest(name="umbrella"))
    good = adapter_root / "good" / "v1"
    tokens = {}
    for tenant in ("acme", "umbrella"):
        admin.register(f"auth/{tenant}", "v1", file_uri(good), digest_adapter_dir(good), BASE, tenant)
        created = admin.call("CreateApiKey", pb.CreateApiKeyRequest(
            scope=pb.KEY_SCOPE_TENANT, tenant=tenant, name=f"{tenant}-reader"))
        tokens[tenant] = created.token
    return tokens


def test_missing_and_unknown_keys(plane: RunningPlane) -> None:
    for token in ("", "slk_nope_nope", ADMIN_TOKEN + "x"):
        assert code_of(lambda t=token: plane.client(t).get("auth/acme")) == UNAUTHENTICATED
    stub_call = plane.admin.stub.GetAdapter
    bad_scheme = (("authorization", f"Basic {ADMIN_TOKEN}"),)
    assert code_of(lambda: stub_call(pb.GetAdapterRequest(adapter_id="x"),
                                     metadata=bad_scheme)) == UNAUTHENTICATED


def test_tenant_key_sees_only_its_tenant(plane: RunningPlane, tenants: dict[str, str]) -> None:
    acme = plane.client(tenants["acme"])
    assert acme.get("auth/acme").tenant == "acme"
    assert code_of(lambda: acme.get("auth/umbrella")) == DENIED
    assert {a.tenant for a in acme.list_all()} == {"acme"}
    assert code_of(lambda: acme.list_all(tenant="umbrella")) == DENIED
    assert {e.tenant for e in acme.events()} == {"acme"}
    assert code_of(lambda: acme.events(tenant="umbrella")) == DENIED
    names = [t.name for t in acme.call("ListTenants", pb.ListTenantsRequest()).tenants]
    assert names == ["acme"]


def refusal(fn) -> tuple[grpc.StatusCode, str]:  # type: ignore[no-untyped-def]
    with pytest.raises(grpc.RpcError) as info:
        fn()
    return info.value.code(), info.value.details()


def test_tenant_key_reading_another_tenants_events_gets_not_found(
        plane: RunningPlane, tenants: dict[str, str]) -> None:
    """Another tenant's adapter answers exactly as an adapter that does not exist (so a key
    cannot even learn that it exists); its own adapter's events come as before."""
    acme = plane.client(tenants["acme"])
    own = acme.events(adapter_id="auth/acme")
    assert own and {e.adapter_id for e in own} == {"auth/acme"}
    other = refusal(lambda: acme.events(adapter_id="auth/umbrella"))
    ghost = refusal(lambda: acme.events(adapter_id="auth/ghost"))
    assert other[0] == ghost[0] == grpc.StatusCode.NOT_FOUND
    assert other[1].replace("umbrella", "X") == ghost[1].replace("ghost", "X")
    # An admin key still reads every tenant's events.
    assert {e.tenant for e in plane.admin.events(adapter_id="auth/umbrella")} == {"umbrella"}


def test_tenant_key_cannot_change_anything(plane: RunningPlane, tenants: dict[str, str],
                                           adapter_root: Path) -> None:
    acme = plane.client(tenants["acme"])
    etag = acme.get("auth/acme").route.etag
    good = adapter_root / "good" / "v2"
    before = plane.dump()
    calls = [
        lambda: acme.promote("auth/acme", "v1", etag=etag),
        lambda: acme.rollback("auth/acme", "x", etag=etag),
        lambda: acme.register("auth/acme", "v2", file_uri(good), digest_adapter_dir(good), BASE,
                              "acme"),
        lambda: acme.call("CreateTenant", pb.CreateTenantRequest(name="evil")),
        lambda: acme.call("CreateApiKey", pb.CreateApiKeyRequest(scope=pb.KEY_SCOPE_ADMIN)),
        lambda: acme.call("ListApiKeys", pb.ListApiKeysRequest()),
    ]
    for call in calls:
        assert code_of(call) == DENIED
    assert plane.dump() == before


def test_keys_are_stored_hashed_and_revocable(plane: RunningPlane) -> None:
    created = plane.admin.call("CreateApiKey", pb.CreateApiKeyRequest(
        scope=pb.KEY_SCOPE_ADMIN, name="ops"))
    token, key_id = created.token, created.key.key_id
    with plane.sessions() as s:
        row = s.get(ApiKey, key_id)
        assert row is not None and row.token_sha256 == hash_token(token)
        assert token not in repr([getattr(row, c.key) for c in ApiKey.__table__.columns])
    ops = plane.client(token)
    assert ops.call("ListApiKeys", pb.ListApiKeysRequest()).keys
    revoked = plane.admin.call("RevokeApiKey", pb.RevokeApiKeyRequest(key_id=key_id))
    assert revoked.HasField("revoked_at")
    assert code_of(lambda: ops.call("ListApiKeys", pb.ListApiKeysRequest())) == UNAUTHENTICATED
    actions = [e.action for e in plane.admin.events()]
    assert "create_key" in actions and "revoke_key" in actions and "bootstrap_key" in actions


@pytest.mark.parametrize(
    ("request_", "code"),
    [
        (pb.CreateApiKeyRequest(scope=pb.KEY_SCOPE_TENANT), grpc.StatusCode.INVALID_ARGUMENT),
        (pb.CreateApiKeyRequest(scope=pb.KEY_SCOPE_ADMIN, tenant="acme"),
         grpc.StatusCode.INVALID_ARGUMENT),
        (pb.CreateApiKeyRequest(scope=pb.KEY_SCOPE_TENANT, tenant="ghost"),
         grpc.StatusCode.NOT_FOUND),
        (pb.CreateApiKeyRequest(), grpc.StatusCode.INVALID_ARGUMENT),
        (pb.CreateTenantRequest(name="acme"), grpc.StatusCode.ALREADY_EXISTS),
        (pb.CreateTenantRequest(name="no spaces"), grpc.StatusCode.INVALID_ARGUMENT),
        (pb.RevokeApiKeyRequest(key_id="ghost"), grpc.StatusCode.NOT_FOUND),
    ],
)
def test_bad_key_requests(plane: RunningPlane, request_, code) -> None:  # type: ignore[no-untyped-def]
    method = {pb.CreateApiKeyRequest: "CreateApiKey", pb.CreateTenantRequest: "CreateTenant",
              pb.RevokeApiKeyRequest: "RevokeApiKey"}[type(request_)]
    before = plane.dump()
    assert code_of(lambda: plane.admin.call(method, request_)) == code
    assert plane.dump() == before


def test_health_and_reflection_need_no_key(plane: RunningPlane) -> None:
    health = health_pb2_grpc.HealthStub(plane.channel)
    for service in ("", "slora.v1.AdapterAdminService"):
        reply = health.Check(health_pb2.HealthCheckRequest(service=service), timeout=10)
        assert reply.status == health_pb2.HealthCheckResponse.SERVING
    stub = reflection_pb2_grpc.ServerReflectionStub(plane.channel)
    replies = list(stub.ServerReflectionInfo(
        iter([reflection_pb2.ServerReflectionRequest(list_services="")]), timeout=10))
    names = {s.name for s in replies[0].list_services_response.service}
    assert "slora.v1.AdapterAdminService" in names and "grpc.health.v1.Health" in names


def test_bootstrap_key_is_idempotent_and_replaceable(plane: RunningPlane) -> None:
    keys = plane.plane.keys
    assert keys.ensure_bootstrap_key(ADMIN_TOKEN).key_id == "bootstrap"
    before = plane.dump()
    keys.ensure_bootstrap_key(ADMIN_TOKEN)
    assert plane.dump() == before
    new_token = "another-bootstrap-token-abcdefghij"
    keys.ensure_bootstrap_key(new_token)
    try:
        assert code_of(lambda: plane.admin.get("auth/acme")) == UNAUTHENTICATED
        assert plane.client(new_token).get("auth/acme").adapter_id == "auth/acme"
    finally:
        keys.ensure_bootstrap_key(ADMIN_TOKEN)
