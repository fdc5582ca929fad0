"""Engine and adapter errors as data-plane status codes: the one place the worker decides."""

from __future__ import annotations

from services.common import errors as e
from slora_core.adapter_cache import UnknownAdapterError
from slora_core.adapters import AdapterFormatError, AdapterIncompatibleError
from slora_core.engine import QueueFullError, RequestError

# How long a client should wait before retrying a full queue: about one decode step of a busy
# batch on a GPU; clients add their own jitter.
QUEUE_RETRY_AFTER_MS = 200


def translate(exc: BaseException) -> e.ServiceError | None:
    """The ServiceError for an engine-side exception, None when it is not an expected one."""
    if isinstance(exc, UnknownAdapterError):
        return e.NotFound(str(exc))
    if isinstance(exc, QueueFullError):
        return e.ResourceExhausted(f"queue full: {exc}", retry_after_ms=QUEUE_RETRY_AFTER_MS)
    if isinstance(exc, AdapterIncompatibleError):
        return e.FailedPrecondition(str(exc), adapter_error=True)
    if isinstance(exc, AdapterFormatError):
        return e.InvalidArgument(str(exc), adapter_error=True)
    if isinstance(exc, RequestError | ValueError):
        # SamplingParams validation raises ValueError naming the field.
        return e.InvalidArgument(str(exc))
    return None


def to_service_error(exc: BaseException) -> e.ServiceError:
    return e.as_service_error(exc, translate)
