"""Caps on what one Generate request may ask for, checked before any tokenization or queueing.

A request past a cap is refused with INVALID_ARGUMENT at once, in microseconds: nothing
proportional to its size runs first (no tokenizer pass over a megabyte, no stop-string matcher
built from 100,000 strings), so an oversized request cannot stall the others on its process.

Why these numbers: a prompt byte cap of 512 KiB is ~128k tokens at 4 bytes a token, past the
context of the models we serve; OpenAI accepts 4 stop strings and 20 top logprobs, we allow 16
stop strings (each at most 256 bytes, so matching costs at most 4 KiB of suffix per token).
`Limits` can be built with other values where a deployment needs them.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from services.common.errors import InvalidArgument
from services.common.names import check_adapter_id, check_version
from slora.v1 import inference_pb2 as pb


@dataclass(frozen=True)
class Limits:
    prompt_bytes: int = 512 << 10      # UTF-8 bytes of text, or of all chat messages together
    prompt_token_ids: int = 131_072    # token_ids input
    chat_messages: int = 1024
    stop_strings: int = 16
    stop_string_bytes: int = 256
    stop_token_ids: int = 64
    top_logprobs: int = 20
    max_new_tokens: int = 32_768
    n: int = 16                        # choices per request (HTTP `n`)
    request_id_chars: int = 128
    routing_key_chars: int = 256


DEFAULT_LIMITS = Limits()


def _cap(what: str, value: int, limit: int, low: int = 0) -> None:
    if not low <= value <= limit:
        raise InvalidArgument(f"{what} is {value}; allowed {low}..{limit}")


def prompt_bytes(request: pb.GenerateRequest) -> int:
    """UTF-8 bytes of the request's text input (text, or all chat messages' contents)."""
    if request.WhichOneof("input") == "text":
        return len(request.text.encode("utf-8"))
    return sum(len(m.content.encode("utf-8")) + len(m.role.encode("utf-8"))
               for m in request.messages)


def check_sampling(sampling: pb.SamplingOptions, limits: Limits = DEFAULT_LIMITS) -> None:
    """Raise InvalidArgument when `sampling` asks for more than `limits` allow."""
    _cap("number of stop strings", len(sampling.stop), limits.stop_strings)
    for stop in sampling.stop:
        _cap("a stop string's length in bytes", len(stop.encode("utf-8")),
             limits.stop_string_bytes, low=1)
    _cap("number of stop_token_ids", len(sampling.stop_token_ids), limits.stop_token_ids)
    _cap("top_logprobs", sampling.top_logprobs, limits.top_logprobs)
    _cap("max_new_tokens", sampling.max_new_tokens, limits.max_new_tokens)
    _cap("min_new_tokens", sampling.min_new_tokens, limits.max_new_tokens)


def check_token_ids(ids: Sequence[int], vocab_size: int | None = None) -> None:
    """Raise InvalidArgument for a negative token id, or one at or past `vocab_size` when it is
    known (the worker knows it; the gateway checks the sign only)."""
    if not ids:
        return
    low, high = min(ids), max(ids)
    if low < 0:
        raise InvalidArgument(f"token id {low} is out of range (token ids are >= 0)")
    if vocab_size is not None and high >= vocab_size:
        raise InvalidArgument(f"token id {high} is out of range [0, {vocab_size})")


def check_n(n: int, limits: Limits = DEFAULT_LIMITS) -> None:
    """Raise InvalidArgument unless 1 <= n <= limits.n (the HTTP API's `n`)."""
    _cap("n", n, limits.n, low=1)


def check_generate(request: pb.GenerateRequest, limits: Limits = DEFAULT_LIMITS) -> None:
    """Raise InvalidArgument for a Generate request past any cap or naming an invalid adapter
    id or version. Cheap (no tokenization): call it first, on the event loop."""
    _cap("request_id length", len(request.request_id), limits.request_id_chars)
    _cap("routing_key length", len(request.routing_key), limits.routing_key_chars)
    _cap("number of chat messages", len(request.messages), limits.chat_messages)
    _cap("prompt size in bytes", prompt_bytes(request), limits.prompt_bytes)
    _cap("number of prompt token ids", len(request.token_ids.ids), limits.prompt_token_ids)
    check_token_ids(request.token_ids.ids)
    if request.adapter.adapter_id:
        check_adapter_id(request.adapter.adapter_id)
    if request.adapter.HasField("version"):
        check_version(request.adapter.version)
    check_sampling(request.sampling, limits)
