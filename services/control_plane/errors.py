"""Registry errors and their gRPC status codes, in one place (DESIGN section 2).

The registry raises plain Python exceptions; `status_for` turns any of them into the code a
client sees. The engine's adapter validator errors map here too, so the servicer never decides.
"""

from __future__ import annotations

import grpc
from sqlalchemy.exc import OperationalError

from services.common.errors import ServiceError
from services.control_plane.lifecycle import IllegalTransition, UnknownVersion
from slora_core.adapters import AdapterFormatError, AdapterIncompatibleError


class RegistryError(Exception):
    """Base class of errors the registry raises on purpose."""


class NotFound(RegistryError):
    """Unknown adapter, version, tenant or key."""


class InvalidArgument(RegistryError):
    """A malformed request, unreadable storage URI, or checksum mismatch."""


class FailedPrecondition(RegistryError):
    """The request is well formed but the registry's state does not allow it."""


class AlreadyExists(RegistryError):
    """The same version is already registered with different content."""


class Aborted(RegistryError):
    """The caller's etag is stale: someone changed the route since it was read."""


class Unauthenticated(RegistryError):
    """Missing, unknown or revoked API key."""


class PermissionDenied(RegistryError):
    """The key lacks the scope or tenant the call needs."""


# Most specific first: the first matching class wins.
_CODES: tuple[tuple[type[BaseException], grpc.StatusCode], ...] = (
    (NotFound, grpc.StatusCode.NOT_FOUND),
    (UnknownVersion, grpc.StatusCode.NOT_FOUND),
    (InvalidArgument, grpc.StatusCode.INVALID_ARGUMENT),
    (AdapterFormatError, grpc.StatusCode.INVALID_ARGUMENT),
    (FailedPrecondition, grpc.StatusCode.FAILED_PRECONDITION),
    (IllegalTransition, grpc.StatusCode.FAILED_PRECONDITION),
    (AdapterIncompatibleError, grpc.StatusCode.FAILED_PRECONDITION),
    (AlreadyExists, grpc.StatusCode.ALREADY_EXISTS),
    (Aborted, grpc.StatusCode.ABORTED),
    (Unauthenticated, grpc.StatusCode.UNAUTHENTICATED),
    (PermissionDenied, grpc.StatusCode.PERMISSION_DENIED),
    # Database unreachable, or SQLite busy past its timeout: worth retrying later.
    (OperationalError, grpc.StatusCode.UNAVAILABLE),
)


def status_for(exc: BaseException) -> grpc.StatusCode | None:
    """The gRPC code for an expected error, or None for a bug (reported as INTERNAL)."""
    if isinstance(exc, ServiceError):  # shared checks (services.common.names, limits)
        return exc.code
    for cls, code in _CODES:
        if isinstance(exc, cls):
            return code
    return None
