"""OpenAI response bodies and stream chunks from the routing path's `GenerateResponse`s.

The gateway holds no tokenizer, so a token in `logprobs` is written as `token_id:<id>` (the form
vLLM uses with `--return-tokens-as-token-ids`), and completions' `text_offset` is left out.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Literal

import msgspec

from services.common import errors as e
from slora.v1 import inference_pb2 as pb

Kind = Literal["completion", "chat"]
OBJECT = {"completion": "text_completion", "chat": "chat.completion"}
CHUNK_OBJECT = {"completion": "text_completion", "chat": "chat.completion.chunk"}
DONE = b"data: [DONE]\n\n"


def token_name(token_id: int) -> str:
    return f"token_id:{token_id}"


def error_body(err: e.ServiceError) -> dict[str, Any]:
    """OpenAI's error shape."""
    _status, kind = e.http_status(err)
    return {"error": {"message": str(err), "type": kind, "param": None, "code": err.code.name}}


def served_name(served: pb.ServedBy, base_model: str) -> str:
    """`adapter@version` of what served a call, or the base model's name."""
    if not served.adapter_id:
        return base_model
    return f"{served.adapter_id}@{served.adapter_version}"


def served_header(served: pb.ServedBy, base_model: str) -> str:
    """The `x-slora-served-by` header: what served the call, and where."""
    fallback = "; fallback" if served.is_fallback else ""
    return f"{served_name(served, base_model)}; worker={served.worker_id}{fallback}"


def _completion_logprobs(lps: list[pb.TokenLogprob]) -> dict[str, Any]:
    return {"tokens": [token_name(lp.token_id) for lp in lps],
            "token_logprobs": [lp.logprob for lp in lps],
            "top_logprobs": [{token_name(t.token_id): t.logprob for t in lp.top_logprobs}
                             for lp in lps],
            "text_offset": None}


def _chat_logprobs(lps: list[pb.TokenLogprob]) -> dict[str, Any]:
    return {"content": [{"token": token_name(lp.token_id), "logprob": lp.logprob, "bytes": None,
                         "top_logprobs": [{"token": token_name(t.token_id),
                                           "logprob": t.logprob, "bytes": None}
                                          for t in lp.top_logprobs]}
                        for lp in lps]}


def logprobs_json(kind: Kind, lps: list[pb.TokenLogprob]) -> dict[str, Any]:
    return _completion_logprobs(lps) if kind == "completion" else _chat_logprobs(lps)


@dataclass
class ChoiceState:
    """One choice as its call goes: text and logprobs so far, then its `complete`."""

    index: int
    text: list[str] = field(default_factory=list)
    logprobs: list[pb.TokenLogprob] = field(default_factory=list)
    complete: pb.Complete | None = None
    started: bool = False  # a chat choice's first delta carries the role

    def add(self, r: pb.GenerateResponse) -> None:
        if r.HasField("chunk"):
            self.text.append(r.chunk.text)
            self.logprobs.extend(r.chunk.logprobs)
        else:
            self.complete = r.complete


def usage_json(choices: list[ChoiceState], n: int) -> dict[str, int]:
    """OpenAI counts a prompt once however many samples it had."""
    prompt = sum(c.complete.usage.prompt_tokens for c in choices
                 if c.complete is not None and c.index % n == 0)
    completion = sum(c.complete.usage.completion_tokens for c in choices
                     if c.complete is not None)
    return {"prompt_tokens": prompt, "completion_tokens": completion,
            "total_tokens": prompt + completion}


@dataclass(frozen=True)
class Header:
    """What every body and chunk of one response starts with."""

    kind: Kind
    id: str
    model: str
    fingerprint: str
    created: int = field(default_factory=lambda: int(time.time()))

    def fields(self, stream: bool) -> dict[str, Any]:
        obj = CHUNK_OBJECT[self.kind] if stream else OBJECT[self.kind]
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model,
                "system_fingerprint": self.fingerprint}


def full_body(h: Header, choices: list[ChoiceState], n: int, with_logprobs: bool,
              ) -> dict[str, Any]:
    """A non-streaming response."""
    out = []
    for c in choices:
        assert c.complete is not None
        text = "".join(c.text)
        choice: dict[str, Any] = {"index": c.index, "finish_reason": c.complete.finish_reason,
                                  "logprobs": (logprobs_json(h.kind, c.logprobs)
                                               if with_logprobs else None)}
        if h.kind == "chat":
            choice["message"] = {"role": "assistant", "content": text}
        else:
            choice["text"] = text
        out.append(choice)
    return {**h.fields(stream=False), "choices": out, "usage": usage_json(choices, n)}


_encoder = msgspec.json.Encoder()  # a C encoder: an SSE event per token is the hot path


def sse(payload: dict[str, Any]) -> bytes:
    return b"data: " + _encoder.encode(payload) + b"\n\n"


class StreamEvents:
    """The events of one streamed response. Every chunk event starts with the same header
    fields, so they are encoded once; per event only its choice is encoded."""

    def __init__(self, h: Header, with_logprobs: bool, include_usage: bool) -> None:
        self.header, self.with_logprobs = h, with_logprobs
        head = _encoder.encode(h.fields(stream=True))  # b'{...}': reopened for "choices"
        self._prefix = b"data: " + head[:-1] + b',"choices":['
        self._suffix = (b'],"usage":null}' if include_usage else b"]}") + b"\n\n"

    def chunk(self, c: ChoiceState, r: pb.GenerateResponse) -> bytes:
        """The event of one message of choice `c` (already added to `c`)."""
        kind = self.header.kind
        choice: dict[str, Any] = {"index": c.index, "logprobs": None, "finish_reason": None}
        if r.HasField("chunk"):
            if self.with_logprobs:
                choice["logprobs"] = logprobs_json(kind, list(r.chunk.logprobs))
            text = r.chunk.text
        else:
            choice["finish_reason"] = r.complete.finish_reason
            text = ""
        if kind == "chat":
            delta: dict[str, Any] = {} if r.HasField("complete") else {"content": text}
            if not c.started:
                delta["role"] = "assistant"
            choice["delta"] = delta
        else:
            choice["text"] = text
        c.started = True
        return self._prefix + _encoder.encode(choice) + self._suffix


def usage_event(h: Header, choices: list[ChoiceState], n: int) -> bytes:
    """The last event before [DONE] when `stream_options.include_usage` is set."""
    return sse({**h.fields(stream=True), "choices": [], "usage": usage_json(choices, n)})
