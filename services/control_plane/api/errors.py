"""The control plane's error-to-status mapping, in one place (DESIGN section 2).

The registry raises the shared `services.common.errors` classes (NotFound, InvalidArgument,
Aborted, ...), which carry their own gRPC code. `status_for` adds the codes of the domain and
library exceptions that are not ServiceErrors (lifecycle, the engine's adapter validator, the
database driver), so the control plane's single error interceptor decides every code, and
`details_for` the message the client reads.
"""

from __future__ import annotations

import grpc
from sqlalchemy.exc import DBAPIError, OperationalError
from sqlalchemy.exc import TimeoutError as PoolTimeoutError

from services.common.errors import ServiceError
from services.control_plane.domain.lifecycle import IllegalTransition, UnknownVersion
from slora_core.adapters import AdapterFormatError, AdapterIncompatibleError

# Most specific first: the first matching class wins.
_CODES: tuple[tuple[type[BaseException], grpc.StatusCode], ...] = (
    (UnknownVersion, grpc.StatusCode.NOT_FOUND),
    (AdapterFormatError, grpc.StatusCode.INVALID_ARGUMENT),
    (IllegalTransition, grpc.StatusCode.FAILED_PRECONDITION),
    (AdapterIncompatibleError, grpc.StatusCode.FAILED_PRECONDITION),
)


def database_unavailable(exc: BaseException) -> bool:
    """True for a database failure worth retrying later: the database unreachable or SQLite
    busy past its timeout (OperationalError), no pooled connection free in time (the pool's
    TimeoutError), or a connection the driver found dropped mid-call (any DBAPIError that
    invalidated its connection, e.g. psycopg's InterfaceError)."""
    if isinstance(exc, OperationalError | PoolTimeoutError):
        return True
    return isinstance(exc, DBAPIError) and exc.connection_invalidated


def status_for(exc: BaseException) -> grpc.StatusCode | None:
    """The gRPC code for an expected error, or None for a bug (reported as INTERNAL)."""
    if isinstance(exc, ServiceError):
        return exc.code
    if database_unavailable(exc):
        # Also while checking a caller's credential: an outage is neither a refusal nor a bug.
        return grpc.StatusCode.UNAVAILABLE
    for cls, code in _CODES:
        if isinstance(exc, cls):
            return code
    return None


def details_for(exc: BaseException) -> str:
    """The message a client reads for an expected error. A database failure names its class
    only: the driver's text carries the SQL and its parameters (a token's hash, say)."""
    if database_unavailable(exc):
        return (f"the registry database is unavailable ({type(exc).__name__}); "
                "retry in a moment")
    return str(exc)
