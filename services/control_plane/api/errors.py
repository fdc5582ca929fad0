"""The control plane's error-to-status mapping, in one place (DESIGN section 2).

The registry raises the shared `services.common.errors` classes (NotFound, InvalidArgument,
Aborted, ...), which carry their own gRPC code. `status_for` adds the codes of the domain and
library exceptions that are not ServiceErrors (lifecycle, the engine's adapter validator, the
database driver), so the control plane's single error interceptor decides every code.
"""

from __future__ import annotations

import grpc
from sqlalchemy.exc import OperationalError

from services.common.errors import ServiceError
from services.control_plane.domain.lifecycle import IllegalTransition, UnknownVersion
from slora_core.adapters import AdapterFormatError, AdapterIncompatibleError

# Most specific first: the first matching class wins.
_CODES: tuple[tuple[type[BaseException], grpc.StatusCode], ...] = (
    (UnknownVersion, grpc.StatusCode.NOT_FOUND),
    (AdapterFormatError, grpc.StatusCode.INVALID_ARGUMENT),
    (IllegalTransition, grpc.StatusCode.FAILED_PRECONDITION),
    (AdapterIncompatibleError, grpc.StatusCode.FAILED_PRECONDITION),
    # Database unreachable, or SQLite busy past its timeout: worth retrying later.
    (OperationalError, grpc.StatusCode.UNAVAILABLE),
)


def status_for(exc: BaseException) -> grpc.StatusCode | None:
    """The gRPC code for an expected error, or None for a bug (reported as INTERNAL)."""
    if isinstance(exc, ServiceError):
        return exc.code
    for cls, code in _CODES:
        if isinstance(exc, cls):
            return code
    return None
