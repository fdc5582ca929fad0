"""Errors raised while reading and validating a PEFT LoRA adapter.

Two kinds, because callers map them to different gRPC codes (DESIGN section 2):
the files themselves are bad (INVALID_ARGUMENT), or they are fine but cannot be served on this
base model / engine (FAILED_PRECONDITION).
"""

from __future__ import annotations


class AdapterError(ValueError):
    """Base class; the message names the file, tensor or field and the problem."""


class AdapterFormatError(AdapterError):
    """Bad or unreadable files, malformed config, non-finite values, checksum mismatch."""


class AdapterIncompatibleError(AdapterError):
    """Valid files that do not fit the base model, exceed the rank limit, or use an unsupported
    PEFT feature (DoRA, modules_to_save, LoRA bias, embedding LoRA, ...)."""
