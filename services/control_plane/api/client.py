"""A small synchronous client of the admin API (used by `slora admin` and the tests)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import grpc

from services.common.tls import TlsConfig, open_sync_channel
from slora.v1 import admin_pb2 as pb
from slora.v1 import admin_pb2_grpc as pb_grpc


class AdminClient:
    """`AdapterAdminService` with the bearer token attached to every call.

    Route changes take an etag; when none is given the client reads the adapter first and uses
    the etag it got, so a change made by someone else in between is still refused (ABORTED).
    """

    def __init__(self, channel: grpc.Channel, token: str, timeout_s: float = 60.0) -> None:
        self.stub = pb_grpc.AdapterAdminServiceStub(channel)
        self._metadata = (("authorization", f"Bearer {token}"),) if token else ()
        self._timeout = timeout_s

    @classmethod
    def connect(cls, target: str, token: str, timeout_s: float = 60.0,
                tls: TlsConfig | None = None) -> AdminClient:
        """A client over a new channel: TLS with `tls`, or as the environment says."""
        return cls(open_sync_channel(target, tls), token, timeout_s)

    def call(self, method: str, request: Any) -> Any:
        """Invoke `method` (e.g. 'GetAdapter') with auth metadata and the default deadline."""
        return getattr(self.stub, method)(request, metadata=self._metadata, timeout=self._timeout)

    def etag(self, adapter_id: str, etag: str | None) -> str:
        return etag or self.get(adapter_id).route.etag

    def register(self, adapter_id: str, version: str, storage_uri: str, sha256: str,
                 base_model: str, tenant: str,
                 labels: Mapping[str, str] | None = None) -> pb.AdapterVersionInfo:
        return self.call("RegisterAdapterVersion", pb.RegisterAdapterVersionRequest(
            adapter_id=adapter_id, version=version, storage_uri=storage_uri, sha256=sha256,
            base_model=base_model, tenant=tenant, labels=dict(labels or {})))

    def canary(self, adapter_id: str, version: str, ratio: float, etag: str | None = None,
               reason: str = "") -> pb.AdapterInfo:
        return self.call("StartCanary", pb.StartCanaryRequest(
            adapter_id=adapter_id, version=version, traffic_ratio=ratio,
            etag=self.etag(adapter_id, etag), reason=reason))

    def promote(self, adapter_id: str, version: str, etag: str | None = None,
                reason: str = "") -> pb.AdapterInfo:
        return self.call("Promote", pb.PromoteRequest(
            adapter_id=adapter_id, version=version, etag=self.etag(adapter_id, etag),
            reason=reason))

    def rollback(self, adapter_id: str, reason: str, etag: str | None = None) -> pb.AdapterInfo:
        return self.call("Rollback", pb.RollbackRequest(
            adapter_id=adapter_id, reason=reason,
            etag=self.etag(adapter_id, etag)))

    def retire(self, adapter_id: str, version: str, etag: str | None = None,
               reason: str = "") -> pb.AdapterInfo:
        return self.call("Retire", pb.RetireRequest(
            adapter_id=adapter_id, version=version, etag=self.etag(adapter_id, etag),
            reason=reason))

    def set_policy(self, adapter_id: str, policy: pb.CanaryPolicy | None,
                   etag: str | None = None, reason: str = "") -> pb.AdapterInfo:
        """Set the adapter's canary policy; None removes it."""
        return self.call("SetCanaryPolicy", pb.SetCanaryPolicyRequest(
            adapter_id=adapter_id, policy=policy, etag=self.etag(adapter_id, etag),
            reason=reason))

    def status(self, adapter_id: str) -> pb.RolloutStatus:
        return self.call("GetRolloutStatus", pb.GetRolloutStatusRequest(adapter_id=adapter_id))

    def get(self, adapter_id: str) -> pb.AdapterInfo:
        return self.call("GetAdapter", pb.GetAdapterRequest(adapter_id=adapter_id))

    def list_all(self, tenant: str = "", state: pb.VersionState = pb.VERSION_STATE_UNSPECIFIED,
                 base_model: str = "", page_size: int = 0) -> list[pb.AdapterInfo]:
        """Every adapter matching the filters, following page tokens."""
        adapters: list[pb.AdapterInfo] = []
        token = ""
        while True:
            page = self.call("ListAdapters", pb.ListAdaptersRequest(
                tenant=tenant, state=state, base_model=base_model, page_size=page_size,
                page_token=token))
            adapters.extend(page.adapters)
            token = page.next_page_token
            if not token:
                return adapters

    def events(self, adapter_id: str = "", tenant: str = "", limit: int = 0) -> list[pb.AuditEvent]:
        """Audit events oldest first, following page tokens; `limit` > 0 keeps the last ones."""
        events: list[pb.AuditEvent] = []
        token = ""
        while True:
            page = self.call("ListEvents", pb.ListEventsRequest(
                adapter_id=adapter_id, tenant=tenant, page_size=500, page_token=token))
            events.extend(page.events)
            token = page.next_page_token
            if not token:
                return events[-limit:] if limit > 0 else events
