"""The gateway -> worker hop: workers serve `InferenceService` only to callers presenting the
gateway token, so a client that reaches a worker's port cannot skip the gateway's API-key,
tenant and limit checks.

The token (`slg_...`, $SLORA_GATEWAY_TOKEN) is given to gateways and workers only; gateways
send it as `x-slora-gateway` metadata on every worker call (`GatewayTokenInterceptor`, a
client interceptor on their worker channels), workers check it (`GatewayOnlyInterceptor`, a
server interceptor). Health and reflection stay open. mTLS (services/common/tls.py) can be run
as well; the token keeps working without it.
"""

from __future__ import annotations

import logging
import os
import secrets
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from typing import Any

import grpc

from services.common.cluster_token import token_matches

log = logging.getLogger(__name__)
GATEWAY_TOKEN_ENV = "SLORA_GATEWAY_TOKEN"
GATEWAY_HEADER = "x-slora-gateway"
# The caller's tenant, sent by gateways on worker calls; workers pass it to their scheduler's
# per-tenant fairness (trusted because only gateways reach a worker).
TENANT_HEADER = "x-slora-tenant"
PROTECTED_PREFIX = "/slora.v1.InferenceService/"


def new_gateway_token() -> str:
    """A fresh random gateway token (256 bits), for one stack."""
    return "slg_" + secrets.token_urlsafe(32)


def gateway_token_from_env(env: Mapping[str, str] = os.environ) -> str:
    return env.get(GATEWAY_TOKEN_ENV, "")


def _presented(metadata: Any) -> str:
    for key, value in metadata or ():
        if key.lower() == GATEWAY_HEADER:
            return value.decode() if isinstance(value, bytes) else str(value)
    return ""


def _refused(handler: grpc.RpcMethodHandler, message: str) -> grpc.RpcMethodHandler:
    """`handler`'s RPC kind, answering UNAUTHENTICATED without running its behaviour."""
    async def value(_request: Any, context: grpc.aio.ServicerContext) -> Any:
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, message)

    async def stream(_request: Any, context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, message)
        yield  # unreached: makes this an async generator, as streaming handlers must be

    kwargs = {"request_deserializer": handler.request_deserializer,
              "response_serializer": handler.response_serializer}
    if handler.unary_unary:
        return grpc.unary_unary_rpc_method_handler(value, **kwargs)
    if handler.unary_stream:
        return grpc.unary_stream_rpc_method_handler(stream, **kwargs)
    if handler.stream_unary:
        return grpc.stream_unary_rpc_method_handler(value, **kwargs)
    return grpc.stream_stream_rpc_method_handler(stream, **kwargs)


class GatewayOnlyInterceptor(grpc.aio.ServerInterceptor):
    """Install on a worker's server: InferenceService calls without the gateway token get
    UNAUTHENTICATED; other services (health, reflection) are untouched."""

    def __init__(self, token: str) -> None:
        if not token:
            raise ValueError("GatewayOnlyInterceptor needs a gateway token")
        self._token = token

    @classmethod
    def from_env(cls, env: Mapping[str, str] = os.environ) -> list[grpc.aio.ServerInterceptor]:
        """[the interceptor] when $SLORA_GATEWAY_TOKEN is set; [] (and a warning) otherwise."""
        token = gateway_token_from_env(env)
        if not token:
            log.warning("no %s: InferenceService is open to anyone who reaches this worker",
                        GATEWAY_TOKEN_ENV)
            return []
        return [cls(token)]

    async def intercept_service(
        self, continuation: Callable[..., Awaitable[grpc.RpcMethodHandler | None]],
        details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler | None:
        handler = await continuation(details)
        if handler is None or not details.method.startswith(PROTECTED_PREFIX):
            return handler
        if token_matches(_presented(details.invocation_metadata), self._token):
            return handler
        return _refused(handler, "workers serve gateways only: call a gateway "
                                 f"(or present the gateway token as {GATEWAY_HEADER})")


class _AddsToken:
    def __init__(self, token: str) -> None:
        self._entry = (GATEWAY_HEADER, token)

    def _details(self, details: grpc.aio.ClientCallDetails) -> grpc.aio.ClientCallDetails:
        metadata = grpc.aio.Metadata(*(details.metadata or ()), self._entry)
        return grpc.aio.ClientCallDetails(details.method, details.timeout, metadata,
                                          details.credentials, details.wait_for_ready)


class _UnaryStreamToken(_AddsToken, grpc.aio.UnaryStreamClientInterceptor):
    async def intercept_unary_stream(self, continuation: Any, client_call_details: Any,
                                     request: Any) -> Any:
        return await continuation(self._details(client_call_details), request)


class _UnaryUnaryToken(_AddsToken, grpc.aio.UnaryUnaryClientInterceptor):
    async def intercept_unary_unary(self, continuation: Any, client_call_details: Any,
                                    request: Any) -> Any:
        return await continuation(self._details(client_call_details), request)


class _StreamStreamToken(_AddsToken, grpc.aio.StreamStreamClientInterceptor):
    async def intercept_stream_stream(self, continuation: Any, client_call_details: Any,
                                      request_iterator: Any) -> Any:
        return await continuation(self._details(client_call_details), request_iterator)


class GatewayTokenInterceptor:
    """For a gateway's worker channels: client interceptors that add the gateway token to
    every call (grpc.aio files an interceptor under one RPC kind only, hence one per kind)."""

    @staticmethod
    def for_token(token: str) -> list[grpc.aio.ClientInterceptor]:
        return [_UnaryStreamToken(token), _UnaryUnaryToken(token), _StreamStreamToken(token)]

    @staticmethod
    def from_env(env: Mapping[str, str] = os.environ) -> list[grpc.aio.ClientInterceptor]:
        """The interceptors for $SLORA_GATEWAY_TOKEN; [] when it is unset."""
        token = gateway_token_from_env(env)
        return GatewayTokenInterceptor.for_token(token) if token else []
