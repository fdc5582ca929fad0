"""`AdapterAdminService`: convert the request, call the registry in a worker thread, convert
the answer. Errors become status codes in `interceptors.ErrorInterceptor`, auth happens in
`interceptors.AuthInterceptor`; nothing here aborts or checks tokens."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any, TypeVar

import grpc

from services.control_plane.api import convert
from services.control_plane.api.interceptors import ANY_SCOPE, current_principal
from services.control_plane.domain.principal import ADMIN
from services.control_plane.rollout.rollout_status import RolloutView
from services.control_plane.store.keys import KeyStore
from services.control_plane.store.publish import RegisterRequest
from services.control_plane.store.registry import Registry
from slora.v1 import admin_pb2 as pb
from slora.v1 import admin_pb2_grpc as pb_grpc

SERVICE_NAME = pb.DESCRIPTOR.services_by_name["AdapterAdminService"].full_name
_READ_METHODS = ("GetAdapter", "ListAdapters", "ListEvents", "ListTenants", "GetRolloutStatus")
# Reads are open to tenant keys (filtered to their tenant); everything else needs admin.
METHOD_SCOPES: dict[str, str] = {
    f"/{SERVICE_NAME}/{m.name}": (ANY_SCOPE if m.name in _READ_METHODS else ADMIN)
    for m in pb.DESCRIPTOR.services_by_name["AdapterAdminService"].methods
}

T = TypeVar("T")


async def _call(fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
    # Registry calls block on the database, downloads and validation: run them off the loop.
    return await asyncio.to_thread(fn, *args, **kwargs)


def _opt(value: str) -> str | None:
    return value or None


class AdapterAdminServicer(pb_grpc.AdapterAdminServiceServicer):
    def __init__(self, registry: Registry, keys: KeyStore, rollout: RolloutView) -> None:
        self._registry = registry
        self._keys = keys
        self._rollout = rollout

    async def RegisterAdapterVersion(
        self, request: pb.RegisterAdapterVersionRequest, context: grpc.aio.ServicerContext
    ) -> pb.AdapterVersionInfo:
        req = RegisterRequest(
            adapter_id=request.adapter_id, version=request.version,
            storage_uri=request.storage_uri, sha256=request.sha256,
            base_model=request.base_model, tenant=request.tenant, labels=dict(request.labels),
        )
        record = await _call(self._registry.register_version, req, current_principal())
        return convert.version_to_pb(record)

    async def StartCanary(self, request: pb.StartCanaryRequest, context: Any) -> pb.AdapterInfo:
        record = await _call(self._registry.start_canary, request.adapter_id, request.version,
                             request.traffic_ratio, request.etag, current_principal(),
                             request.reason)
        return convert.adapter_to_pb(record)

    async def Promote(self, request: pb.PromoteRequest, context: Any) -> pb.AdapterInfo:
        record = await _call(self._registry.promote, request.adapter_id, request.version,
                             request.etag, current_principal(), request.reason)
        return convert.adapter_to_pb(record)

    async def Rollback(self, request: pb.RollbackRequest, context: Any) -> pb.AdapterInfo:
        record = await _call(self._registry.rollback, request.adapter_id, request.etag,
                             current_principal(), request.reason)
        return convert.adapter_to_pb(record)

    async def Retire(self, request: pb.RetireRequest, context: Any) -> pb.AdapterInfo:
        record = await _call(self._registry.retire, request.adapter_id, request.version,
                             request.etag, current_principal(), request.reason)
        return convert.adapter_to_pb(record)

    async def SetCanaryPolicy(self, request: pb.SetCanaryPolicyRequest,
                              context: Any) -> pb.AdapterInfo:
        policy = convert.policy_from_pb(request)
        record = await _call(self._registry.set_canary_policy, request.adapter_id, policy,
                             request.etag, current_principal(), request.reason)
        return convert.adapter_to_pb(record)

    async def GetRolloutStatus(self, request: pb.GetRolloutStatusRequest,
                               context: Any) -> pb.RolloutStatus:
        status = await _call(self._rollout.status, request.adapter_id, current_principal())
        return convert.rollout_status_to_pb(status)

    async def GetAdapter(self, request: pb.GetAdapterRequest, context: Any) -> pb.AdapterInfo:
        record = await _call(self._registry.get_adapter, request.adapter_id, current_principal())
        return convert.adapter_to_pb(record)

    async def ListAdapters(
        self, request: pb.ListAdaptersRequest, context: Any
    ) -> pb.ListAdaptersResponse:
        records, token = await _call(
            self._registry.list_adapters, current_principal(), tenant=_opt(request.tenant),
            state=convert.state_from_pb(request.state), base_model=_opt(request.base_model),
            page_size=request.page_size, page_token=request.page_token,
        )
        return pb.ListAdaptersResponse(
            adapters=[convert.adapter_to_pb(r) for r in records], next_page_token=token
        )

    async def ListEvents(self, request: pb.ListEventsRequest, context: Any) -> pb.ListEventsResponse:
        records, token = await _call(
            self._registry.list_events, current_principal(), adapter_id=_opt(request.adapter_id),
            tenant=_opt(request.tenant), page_size=request.page_size,
            page_token=request.page_token,
        )
        return pb.ListEventsResponse(
            events=[convert.event_to_pb(e) for e in records], next_page_token=token
        )

    async def CreateTenant(self, request: pb.CreateTenantRequest, context: Any) -> pb.TenantInfo:
        record = await _call(self._keys.create_tenant, request.name, current_principal())
        return convert.tenant_to_pb(record)

    async def ListTenants(
        self, request: pb.ListTenantsRequest, context: Any
    ) -> pb.ListTenantsResponse:
        records = await _call(self._keys.list_tenants, current_principal())
        return pb.ListTenantsResponse(tenants=[convert.tenant_to_pb(t) for t in records])

    async def CreateApiKey(
        self, request: pb.CreateApiKeyRequest, context: Any
    ) -> pb.CreateApiKeyResponse:
        record, token = await _call(
            self._keys.create_key, convert.scope_from_pb(request.scope), _opt(request.tenant),
            request.name, current_principal(),
        )
        return pb.CreateApiKeyResponse(key=convert.key_to_pb(record), token=token)

    async def ListApiKeys(
        self, request: pb.ListApiKeysRequest, context: Any
    ) -> pb.ListApiKeysResponse:
        records = await _call(self._keys.list_keys, current_principal(), _opt(request.tenant))
        return pb.ListApiKeysResponse(keys=[convert.key_to_pb(k) for k in records])

    async def RevokeApiKey(self, request: pb.RevokeApiKeyRequest, context: Any) -> pb.ApiKeyInfo:
        record = await _call(self._keys.revoke_key, request.key_id, current_principal())
        return convert.key_to_pb(record)
