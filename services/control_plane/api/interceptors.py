"""Server interceptors (grpc.aio): error mapping and bearer-token auth, each in one place.

`ErrorInterceptor` turns the exceptions the registry raises into status codes (errors.status_for)
so servicers never call `context.abort` themselves; the auth guards below run inside it, so a
database outage while checking a credential reads UNAVAILABLE, not INTERNAL. `AuthInterceptor`
checks the bearer token of every call except health and reflection, enforces the method's scope,
and makes the caller's `Principal` available to the servicer through `current_principal()`.
Gateways present the cluster token on PlacementService's routing stream; workers present their
own credential on the placement stream (`worker_credentials.py`), whose worker id
`current_worker()` gives.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import logging
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from typing import Any

import grpc

from services.common.cluster_token import bearer_token, token_matches
from services.common.errors import PermissionDenied, Unauthenticated
from services.control_plane.api.errors import database_unavailable, details_for, status_for
from services.control_plane.domain.principal import ADMIN, Principal
from services.control_plane.store.keys import KeyStore
from services.control_plane.store.worker_credentials import WorkerBinding, WorkerCredentials

log = logging.getLogger(__name__)

OPEN_PREFIXES: tuple[str, ...] = ("/grpc.health.v1.", "/grpc.reflection.")
# The data plane's internal streams: workers and gateways carry no API key, they present the
# cluster token (services/common/cluster_token.py).
CLUSTER_PREFIXES: tuple[str, ...] = ("/slora.v1.PlacementService/",)
WORKER_METHOD = "/slora.v1.PlacementService/WatchPlacement"
ANY_SCOPE = "any"
Guard = Callable[[grpc.aio.ServicerContext], contextlib.AbstractAsyncContextManager[None]]

_principal: contextvars.ContextVar[Principal | None] = contextvars.ContextVar(
    "slora_principal", default=None
)
_worker: contextvars.ContextVar[WorkerBinding | None] = contextvars.ContextVar(
    "slora_worker", default=None
)


def current_worker() -> WorkerBinding | None:
    """The worker id and base model the caller's credential is bound to, or None when the
    placement stream was not authenticated by a worker credential (open, or the legacy
    cluster-token mode)."""
    return _worker.get()


def current_principal() -> Principal:
    """The authenticated caller of the RPC being served (set by AuthInterceptor)."""
    principal = _principal.get()
    if principal is None:
        raise Unauthenticated("no authenticated caller (is the AuthInterceptor installed?)")
    return principal


def wrap_handler(handler: grpc.RpcMethodHandler, guard: Guard) -> grpc.RpcMethodHandler:
    """The same handler with every call run inside `guard(context)`, for all four RPC kinds."""
    kwargs = {"request_deserializer": handler.request_deserializer,
              "response_serializer": handler.response_serializer}
    if handler.unary_unary:
        return grpc.unary_unary_rpc_method_handler(_value(handler.unary_unary, guard), **kwargs)
    if handler.stream_unary:
        return grpc.stream_unary_rpc_method_handler(_value(handler.stream_unary, guard), **kwargs)
    if handler.unary_stream:
        return grpc.unary_stream_rpc_method_handler(_stream(handler.unary_stream, guard), **kwargs)
    return grpc.stream_stream_rpc_method_handler(_stream(handler.stream_stream, guard), **kwargs)


def _value(behavior: Callable[..., Awaitable[Any]], guard: Guard) -> Callable[..., Awaitable[Any]]:
    async def call(request: Any, context: grpc.aio.ServicerContext) -> Any:
        async with guard(context):
            return await behavior(request, context)

    return call


def _stream(behavior: Callable[..., Any], guard: Guard) -> Callable[..., AsyncIterator[Any]]:
    async def call(request: Any, context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
        async with guard(context):
            async for item in behavior(request, context):
                yield item

    return call


class ErrorInterceptor(grpc.aio.ServerInterceptor):
    """Maps exceptions to status codes; unexpected ones are logged and reported as INTERNAL."""

    async def intercept_service(
        self, continuation: Callable[..., Awaitable[grpc.RpcMethodHandler | None]],
        details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler | None:
        handler = await continuation(details)
        if handler is None:
            return None
        return wrap_handler(handler, lambda context: _mapped_errors(context, details.method))


@contextlib.asynccontextmanager
async def _mapped_errors(context: grpc.aio.ServicerContext, method: str) -> AsyncIterator[None]:
    try:
        yield
    except (grpc.aio.AbortError, asyncio.CancelledError):
        raise
    except Exception as exc:
        code = status_for(exc)
        if code is None:
            log.exception("unexpected error in %s", method)
            await context.abort(grpc.StatusCode.INTERNAL, f"internal error: {type(exc).__name__}")
        if database_unavailable(exc):
            # The client hears only the class (details_for); the driver's text goes here.
            log.warning("%s: registry database unavailable: %s", method, exc)
        await context.abort(code, details_for(exc))


class AuthInterceptor(grpc.aio.ServerInterceptor):
    """Authenticates every non-open call and checks the method's scope.

    `method_scopes` maps full method names ('/slora.v1.AdapterAdminService/GetAdapter') to
    ADMIN or ANY_SCOPE; a guarded method it does not name needs an admin key. Cluster methods
    (CLUSTER_PREFIXES) need `cluster_token` as their bearer token, and are open only when no
    cluster token is configured (None or ''); with `workers` given, the placement stream
    (WORKER_METHOD) needs a worker credential instead.
    """

    def __init__(self, keys: KeyStore, method_scopes: Mapping[str, str],
                 cluster_token: str | None = None,
                 workers: WorkerCredentials | None = None) -> None:
        self._keys = keys
        self._scopes = dict(method_scopes)
        self._cluster_token = cluster_token or None
        self._workers = workers

    async def intercept_service(
        self, continuation: Callable[..., Awaitable[grpc.RpcMethodHandler | None]],
        details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler | None:
        handler = await continuation(details)
        if handler is None or details.method.startswith(OPEN_PREFIXES):
            return handler
        token = bearer_token(details.invocation_metadata)
        if details.method.startswith(CLUSTER_PREFIXES):
            expected = self._cluster_token
            if expected is None:
                return handler
            workers = self._workers
            if details.method == WORKER_METHOD and workers is not None:
                return wrap_handler(handler, lambda _context: _worker_guard(token, workers))
            return wrap_handler(handler, lambda _context: _cluster_member(token, expected))
        scope = self._scopes.get(details.method, ADMIN)
        return wrap_handler(handler, lambda _context: self._authenticated(token, scope))

    @contextlib.asynccontextmanager
    async def _authenticated(self, token: str, scope: str) -> AsyncIterator[None]:
        # The key lookup is a database read: keep it off the event loop.
        principal = await asyncio.to_thread(self._keys.authenticate, token)
        if scope == ADMIN and not principal.is_admin:
            raise PermissionDenied(f"key {principal.key_id} has scope {principal.scope!r}; admin needed")
        reset = _principal.set(principal)
        try:
            yield
        finally:
            _principal.reset(reset)


@contextlib.asynccontextmanager
async def _worker_guard(token: str, workers: WorkerCredentials) -> AsyncIterator[None]:
    binding = await asyncio.to_thread(workers.authenticate, token)
    # No reset afterwards: each call runs in its own task, whose context copy dies with it;
    # a reset from a streaming call closed early (finalized in another context) raised
    # "ValueError: <Token> was created in a different Context" at ERROR.
    _worker.set(binding)
    yield


@contextlib.asynccontextmanager
async def _cluster_member(token: str, expected: str) -> AsyncIterator[None]:
    if not token_matches(token, expected):
        raise Unauthenticated("PlacementService needs the cluster token (SLORA_CLUSTER_TOKEN)")
    yield
