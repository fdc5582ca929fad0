"""Protobuf <-> plain Python at the service edge (slora_core never sees a `_pb2` type)."""

from __future__ import annotations

from typing import Any

from slora.v1 import inference_pb2 as pb

DEFAULT_MAX_NEW_TOKENS = 64


def sampling_kwargs(s: pb.SamplingOptions) -> dict[str, Any]:
    """Keyword arguments for `SamplingParams`; unset optional fields keep its defaults."""
    kwargs: dict[str, Any] = {
        "max_new_tokens": s.max_new_tokens or DEFAULT_MAX_NEW_TOKENS,
        "min_new_tokens": s.min_new_tokens,
        "stop": tuple(s.stop),
        "stop_token_ids": tuple(s.stop_token_ids),
        "ignore_eos": s.ignore_eos,
        "top_logprobs": s.top_logprobs,
    }
    for name in ("temperature", "top_p", "top_k", "repetition_penalty", "seed"):
        if s.HasField(name):
            kwargs[name] = getattr(s, name)
    return kwargs


def prompt_of(req: pb.GenerateRequest) -> str | list[int] | None:
    """The request's text or token ids; None when neither is set."""
    which = req.WhichOneof("input")
    if which == "text":
        return req.text
    if which == "token_ids":
        return list(req.token_ids.ids)
    return None


def engine_adapter_name(adapter_id: str, version: str) -> str:
    """The name a version is registered under in the engine: one name per (id, version)."""
    return f"{adapter_id}@{version}"
