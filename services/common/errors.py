"""The errors every service raises on purpose, and how they reach a client as gRPC status
codes or HTTP statuses (DESIGN section 2).

Data-plane servicers raise these (or let the worker's engine errors be translated) and call
`abort_with`; the control plane raises the same classes and its one error interceptor
(`services.control_plane.api.errors.status_for`) maps them. Nothing else decides a status code.
"""

from __future__ import annotations

from collections.abc import Callable

import grpc

# Trailing metadata keys the gateway reads from a worker's error.
RETRY_AFTER_MS = "retry-after-ms"
# Set on errors caused by an adapter version that cannot be loaded (bad files, checksum,
# incompatible): the gateway then tries the route's fallback version.
ADAPTER_ERROR = "slora-adapter-error"
# Set on errors a request would meet on any worker (bad token ids, non-finite logits, an
# exception while building it): the gateway answers with it at once instead of trying the
# next worker, where it would fail the same way.
DETERMINISTIC = "slora-deterministic"


class ServiceError(Exception):
    """An error with a gRPC status code chosen on purpose."""

    code: grpc.StatusCode = grpc.StatusCode.INTERNAL

    def __init__(self, message: str, *, adapter_error: bool = False,
                 retry_after_ms: int | None = None, deterministic: bool = False) -> None:
        super().__init__(message)
        self.adapter_error = adapter_error
        self.retry_after_ms = retry_after_ms
        self.deterministic = deterministic

    def metadata(self) -> tuple[tuple[str, str], ...]:
        md: list[tuple[str, str]] = []
        if self.adapter_error:
            md.append((ADAPTER_ERROR, "1"))
        if self.deterministic:
            md.append((DETERMINISTIC, "1"))
        if self.retry_after_ms is not None:
            md.append((RETRY_AFTER_MS, str(self.retry_after_ms)))
        return tuple(md)


class NotFound(ServiceError):
    code = grpc.StatusCode.NOT_FOUND


class InvalidArgument(ServiceError):
    code = grpc.StatusCode.INVALID_ARGUMENT


class FailedPrecondition(ServiceError):
    code = grpc.StatusCode.FAILED_PRECONDITION


class AlreadyExists(ServiceError):
    code = grpc.StatusCode.ALREADY_EXISTS


class Aborted(ServiceError):
    """A conflict with a concurrent change (e.g. a stale etag): read again and retry."""

    code = grpc.StatusCode.ABORTED


class ResourceExhausted(ServiceError):
    code = grpc.StatusCode.RESOURCE_EXHAUSTED


class Unavailable(ServiceError):
    code = grpc.StatusCode.UNAVAILABLE


class Unauthenticated(ServiceError):
    code = grpc.StatusCode.UNAUTHENTICATED


class PermissionDenied(ServiceError):
    code = grpc.StatusCode.PERMISSION_DENIED


class Internal(ServiceError):
    code = grpc.StatusCode.INTERNAL


# A function that turns a domain exception into a ServiceError, or None when it does not know it.
Translator = Callable[[BaseException], ServiceError | None]


def as_service_error(exc: BaseException, translate: Translator | None = None) -> ServiceError:
    """`exc` as a ServiceError; unknown exceptions are bugs and become INTERNAL."""
    if isinstance(exc, ServiceError):
        return exc
    if translate is not None:
        mapped = translate(exc)
        if mapped is not None:
            return mapped
    return Internal(f"internal error: {type(exc).__name__}: {exc}")


async def abort_with(context: grpc.aio.ServicerContext, err: ServiceError) -> None:
    """End the call with `err`'s code, message and trailing metadata (never returns)."""
    context.set_trailing_metadata(err.metadata())
    await context.abort(err.code, str(err))


def error_from_rpc(exc: grpc.aio.AioRpcError) -> ServiceError:
    """A ServiceError carrying an upstream call's code, message and metadata, to pass it on."""
    md = {k: v for k, v in (exc.trailing_metadata() or ())}
    retry = md.get(RETRY_AFTER_MS)
    err = ServiceError(exc.details() or exc.code().name,
                       adapter_error=ADAPTER_ERROR in md,
                       retry_after_ms=int(retry) if isinstance(retry, str) and retry.isdigit() else None,
                       deterministic=DETERMINISTIC in md)
    err.code = exc.code()
    return err


# ---- the HTTP edge ------------------------------------------------------------------------
# The one table from a gRPC status code to what an OpenAI-compatible HTTP client sees: the HTTP
# status and OpenAI's error `type`. The gateway's gRPC and HTTP fronts raise the same
# ServiceErrors; only this table tells them apart.
HTTP_ERRORS: dict[grpc.StatusCode, tuple[int, str]] = {
    grpc.StatusCode.INVALID_ARGUMENT: (400, "invalid_request_error"),
    grpc.StatusCode.FAILED_PRECONDITION: (400, "invalid_request_error"),
    grpc.StatusCode.OUT_OF_RANGE: (400, "invalid_request_error"),
    grpc.StatusCode.UNAUTHENTICATED: (401, "authentication_error"),
    grpc.StatusCode.PERMISSION_DENIED: (403, "permission_error"),
    grpc.StatusCode.NOT_FOUND: (404, "not_found_error"),
    grpc.StatusCode.ALREADY_EXISTS: (409, "conflict_error"),
    grpc.StatusCode.ABORTED: (409, "conflict_error"),
    grpc.StatusCode.RESOURCE_EXHAUSTED: (429, "rate_limit_error"),
    grpc.StatusCode.CANCELLED: (499, "cancelled_error"),
    grpc.StatusCode.UNIMPLEMENTED: (501, "not_implemented_error"),
    grpc.StatusCode.UNAVAILABLE: (503, "service_unavailable_error"),
    grpc.StatusCode.DEADLINE_EXCEEDED: (504, "timeout_error"),
}
HTTP_INTERNAL = (500, "api_error")  # INTERNAL, UNKNOWN, DATA_LOSS and anything unlisted


def http_status(err: ServiceError) -> tuple[int, str]:
    """(HTTP status, OpenAI error type) of `err`."""
    return HTTP_ERRORS.get(err.code, HTTP_INTERNAL)


def retry_after_seconds(err: ServiceError) -> int | None:
    """The `Retry-After` header's value (whole seconds, at least 1), when the error has one."""
    if err.retry_after_ms is None:
        return None
    return max(1, -(-err.retry_after_ms // 1000))
