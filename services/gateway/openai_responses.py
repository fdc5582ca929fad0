"""OpenAI response bodies and stream chunks from the routing path's `GenerateResponse`s.

Logprob tokens are the tokens' text as the worker decoded them, with their UTF-8 `bytes`;
completions' `text_offset` counts characters from the start of the choice's text (the prompt's
included with `echo`), as vLLM does. Errors carry OpenAI's `type`, an OpenAI-style `code` and
`param` naming the field the caller sent.
"""

from __future__ import annotations

import math
import re
import time
from dataclasses import dataclass, field
from typing import Any, Literal

import grpc
import msgspec

from services.common import errors as e
from services.gateway.tool_calls import ToolCallStream, ToolPlan, message_of, stream_deltas
from slora.v1 import inference_pb2 as pb

Kind = Literal["completion", "chat"]
OBJECT = {"completion": "text_completion", "chat": "chat.completion"}
CHUNK_OBJECT = {"completion": "text_completion", "chat": "chat.completion.chunk"}
DONE = b"data: [DONE]\n\n"

# OpenAI's `code` strings by status (OpenAI sends null for most 400s; a string is more use).
OPENAI_CODES: dict[grpc.StatusCode, str] = {
    grpc.StatusCode.INVALID_ARGUMENT: "invalid_value",
    grpc.StatusCode.FAILED_PRECONDITION: "invalid_value",
    grpc.StatusCode.OUT_OF_RANGE: "invalid_value",
    grpc.StatusCode.UNAUTHENTICATED: "invalid_api_key",
    grpc.StatusCode.PERMISSION_DENIED: "permission_denied",
    grpc.StatusCode.NOT_FOUND: "model_not_found",
    grpc.StatusCode.ALREADY_EXISTS: "already_exists",
    grpc.StatusCode.ABORTED: "conflict",
    grpc.StatusCode.RESOURCE_EXHAUSTED: "rate_limit_exceeded",
    grpc.StatusCode.CANCELLED: "cancelled",
    grpc.StatusCode.UNIMPLEMENTED: "not_implemented",
    grpc.StatusCode.UNAVAILABLE: "service_unavailable",
    grpc.StatusCode.DEADLINE_EXCEEDED: "timeout",
}
# Fields a worker's message may name, in the routing path's words (what the caller sent is
# looked up in the plan's names first).
KNOWN_FIELDS = ("max_new_tokens", "min_new_tokens", "top_logprobs", "prompt_logprobs",
                "logit_bias", "stop_token_ids", "temperature", "top_p", "top_k", "min_p",
                "repetition_penalty", "presence_penalty", "frequency_penalty", "seed", "stop",
                "messages", "chat_template_kwargs", "prompt", "n")
_CONTEXT = re.compile(r"max_model_len|context length", re.IGNORECASE)
# The engine's words: "prompt (N tokens) + max_new_tokens (M) exceeds ... max_model_len=L"
_OVER = re.compile(r"prompt \((\d+) tokens\) \+ \w+ \((\d+)\).*max_model_len=(\d+)")
PROMPT_FIELD = "@prompt"  # a plan's name for its prompt field (prompt, or chat's messages)


def error_body(err: e.ServiceError, names: dict[str, str] | None = None) -> dict[str, Any]:
    """OpenAI's error shape; internal field names in the message become the caller's."""
    _status, kind = e.http_status(err)
    message = str(err)
    for internal, sent in (names or {}).items():
        if not internal.startswith("@"):
            message = re.sub(rf"\b{internal}\b", sent, message)
    param = getattr(err, "param", None)
    code = getattr(err, "openai_code", None) or OPENAI_CODES.get(err.code, "internal_error")
    if err.code == grpc.StatusCode.NOT_FOUND and "model" not in message and "adapter" not in message:
        code = "not_found"
    if param is None and err.code == grpc.StatusCode.INVALID_ARGUMENT:
        if _CONTEXT.search(message):
            param, code = _context_param(message, names or {}), "context_length_exceeded"
        else:
            param = _first_field(message, names or {})
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


def _context_param(message: str, names: dict[str, str]) -> str:
    """The field to blame for a request past the context: the prompt when it alone fills the
    context, else the max-tokens field."""
    prompt = names.get(PROMPT_FIELD, "prompt")
    over = _OVER.search(message)
    if over is None or int(over.group(1)) >= int(over.group(3)):
        return prompt
    return names.get("max_new_tokens", "max_tokens")


def _first_field(message: str, names: dict[str, str]) -> str | None:
    """The first field a message names (the caller's spelling), None if it names none."""
    fields = {v for k, v in names.items() if not k.startswith("@")} | set(KNOWN_FIELDS)
    hits = [(m.start(), f) for f in fields if (m := re.search(rf"\b{re.escape(f)}\b", message))]
    return min(hits)[1] if hits else None


def served_name(served: pb.ServedBy, base_model: str) -> str:
    """`adapter@version` of what served a call, or the base model's name."""
    if not served.adapter_id:
        return base_model
    return f"{served.adapter_id}@{served.adapter_version}"


def served_header(served: pb.ServedBy, base_model: str) -> str:
    """The `x-slora-served-by` header: what served the call, and where."""
    fallback = "; fallback" if served.is_fallback else ""
    return f"{served_name(served, base_model)}; worker={served.worker_id}{fallback}"


def _logprob(value: float) -> float | None:
    return value if math.isfinite(value) else None  # JSON has no NaN (the first prompt token)


def _completion_logprobs(lps: list[pb.TokenLogprob], offset: int) -> dict[str, Any]:
    offsets = []
    for lp in lps:
        offsets.append(offset)
        offset += len(lp.token)
    return {"tokens": [lp.token for lp in lps],
            "token_logprobs": [_logprob(lp.logprob) for lp in lps],
            "top_logprobs": [{t.token: t.logprob for t in lp.top_logprobs}
                             if math.isfinite(lp.logprob) else None for lp in lps],
            "text_offset": offsets}


def _chat_logprobs(lps: list[pb.TokenLogprob]) -> dict[str, Any]:
    return {"content": [{"token": lp.token, "logprob": lp.logprob,
                         "bytes": list(lp.token_bytes),
                         "top_logprobs": [{"token": t.token, "logprob": t.logprob,
                                           "bytes": list(t.token_bytes)}
                                          for t in lp.top_logprobs]}
                        for lp in lps]}


def logprobs_json(kind: Kind, lps: list[pb.TokenLogprob], offset: int = 0) -> dict[str, Any]:
    return _completion_logprobs(lps, offset) if kind == "completion" else _chat_logprobs(lps)


@dataclass
class ChoiceState:
    """One choice as its call goes: text and logprobs so far, then its `complete`."""

    index: int
    text: list[str] = field(default_factory=list)
    logprobs: list[pb.TokenLogprob] = field(default_factory=list)
    prompt_logprobs: list[pb.TokenLogprob] = field(default_factory=list)
    prompt_text: str = ""
    prompt_tokens: int = 0
    completion_tokens: int = 0
    offset: int = 0  # characters of text so far (text_offset of the next token)
    complete: pb.Complete | None = None
    started: bool = False  # a chat choice's first delta carries the role

    def add(self, r: pb.GenerateResponse) -> None:
        if r.HasField("chunk"):
            c = r.chunk
            if not self.started and not self.text:
                self.prompt_logprobs.extend(c.prompt_logprobs)
                self.prompt_text = self.prompt_text or c.prompt_text
                self.prompt_tokens = c.prompt_tokens or self.prompt_tokens
            self.text.append(c.text)
            self.logprobs.extend(c.logprobs)
            self.completion_tokens += len(c.token_ids)
        else:
            self.complete = r.complete

    @property
    def cumulative_logprob(self) -> float:
        return sum(lp.logprob for lp in self.logprobs)


def usage_json(choices: list[ChoiceState], per_prompt: int, generated: bool = True,
               ) -> dict[str, Any]:
    """OpenAI counts a prompt once however many samples it had. The prefix cache's share of
    the prompt (`prompt_tokens_details.cached_tokens`) comes with each choice's end, so it is
    left out while some counted choice is still running (continuous usage stats)."""
    firsts = [c for c in choices if c.index % per_prompt == 0]
    prompt = sum(_prompt_tokens(c) for c in firsts)
    completion = sum(c.complete.usage.completion_tokens if c.complete is not None
                     else c.completion_tokens for c in choices) if generated else 0
    usage: dict[str, Any] = {"prompt_tokens": prompt, "completion_tokens": completion,
                             "total_tokens": prompt + completion}
    if all(c.complete is not None for c in firsts):
        usage["prompt_tokens_details"] = {"cached_tokens": sum(
            c.complete.usage.cached_tokens for c in firsts if c.complete is not None)}
    return usage


def _prompt_tokens(c: ChoiceState) -> int:
    return c.complete.usage.prompt_tokens if c.complete is not None else c.prompt_tokens


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


@dataclass(frozen=True)
class Shape:
    """What the caller asked the response to hold besides text."""

    with_logprobs: bool = False
    echo: bool = False
    prompt_logprobs: bool = False
    n: int = 1
    best_of: int = 1
    tools: ToolPlan | None = None  # chat tools: the output is parsed into tool_calls
    drop_generated: bool = False  # echo with max_tokens 0: the prompt alone


def best(choices: list[ChoiceState], n: int, best_of: int) -> list[ChoiceState]:
    """Of each prompt's `best_of` samples, the `n` most likely (highest cumulative logprob,
    vLLM's rule), renumbered 0.. in order."""
    if best_of == n:
        return choices
    kept: list[ChoiceState] = []
    for start in range(0, len(choices), best_of):
        group = sorted(choices[start:start + best_of], key=lambda c: -c.cumulative_logprob)
        kept += group[:n]
    for i, c in enumerate(kept):
        c.index = i
    return kept


def _completion_choice(c: ChoiceState, shape: Shape, prompt: str | None) -> dict[str, Any]:
    text = "" if shape.drop_generated else "".join(c.text)
    lps = [] if shape.drop_generated else list(c.logprobs)
    offset = 0
    if shape.echo:
        echoed = prompt if prompt is not None else c.prompt_text
        text = echoed + text
        if shape.with_logprobs:
            lps = list(c.prompt_logprobs) + lps
    choice: dict[str, Any] = {"index": c.index, "text": text,
                              "logprobs": (logprobs_json("completion", lps, offset)
                                           if shape.with_logprobs else None)}
    if shape.prompt_logprobs:
        choice["prompt_logprobs"] = prompt_logprobs_json(c.prompt_logprobs)
    return choice


def prompt_logprobs_json(lps: list[pb.TokenLogprob]) -> list[dict[str, Any] | None]:
    """vLLM's `prompt_logprobs`: per prompt token, {id: {logprob, rank, decoded_token}} of the
    token and its alternatives; None for the first token."""
    out: list[dict[str, Any] | None] = []
    for lp in lps:
        if not math.isfinite(lp.logprob):
            out.append(None)
            continue
        entry = {str(t.token_id): {"logprob": t.logprob, "rank": i + 1,
                                   "decoded_token": t.token}
                 for i, t in enumerate(lp.top_logprobs)}
        entry.setdefault(str(lp.token_id), {"logprob": lp.logprob, "rank": None,
                                            "decoded_token": lp.token})
        out.append(entry)
    return out


def full_body(h: Header, choices: list[ChoiceState], shape: Shape,
              prompts: list[str | None]) -> dict[str, Any]:
    """A non-streaming response."""
    usage = usage_json(choices, shape.best_of, not shape.drop_generated)
    out = []
    for c in best(choices, shape.n, shape.best_of):
        assert c.complete is not None
        prompt_index = c.index // shape.n
        reason = c.complete.finish_reason
        if h.kind == "chat":
            message, reason = message_of("".join(c.text), reason, shape.tools)
            choice: dict[str, Any] = {
                "index": c.index, "message": message,
                "logprobs": _chat_logprobs(c.logprobs) if shape.with_logprobs else None}
        else:
            prompt = prompts[prompt_index] if prompt_index < len(prompts) else None
            choice = _completion_choice(c, shape, prompt)
        choice["finish_reason"] = ("length" if shape.drop_generated and h.kind == "completion"
                                   else reason)
        out.append(choice)
    return {**h.fields(stream=False), "choices": out, "usage": usage}


_encoder = msgspec.json.Encoder()  # a C encoder: an SSE event per token is the hot path


def sse(payload: dict[str, Any]) -> bytes:
    return b"data: " + _encoder.encode(payload) + b"\n\n"


class StreamEvents:
    """The events of one streamed response. Every chunk event starts with the same header
    fields, so they are encoded once; per event only its choice (and, with continuous usage
    stats, the usage) is encoded."""

    def __init__(self, h: Header, shape: Shape, include_usage: bool,
                 continuous_usage: bool = False, prompts: list[str | None] | None = None,
                 names: dict[str, str] | None = None) -> None:
        self.header, self.shape = h, shape
        self.names = names or {}  # internal field names -> the caller's (for errors)
        self.with_logprobs = shape.with_logprobs
        self.continuous = include_usage and continuous_usage
        self.prompts = prompts or []
        head = _encoder.encode(h.fields(stream=True))  # b'{...}': reopened for "choices"
        self._prefix = b"data: " + head[:-1] + b',"choices":['
        self._suffix = (b'],"usage":null}' if include_usage else b"]}") + b"\n\n"
        self._tool_streams: dict[int, ToolCallStream] = {}

    def chunk(self, c: ChoiceState, r: pb.GenerateResponse) -> bytes:
        """The event of one message of choice `c` (already added to `c`)."""
        kind = self.header.kind
        if kind == "chat" and self.shape.tools is not None:
            return self._tool_chunk(c, r)
        choice: dict[str, Any] = {"index": c.index, "logprobs": None, "finish_reason": None}
        if r.HasField("chunk"):
            text = "" if self.shape.drop_generated else r.chunk.text
            lps = [] if self.shape.drop_generated else list(r.chunk.logprobs)
            if kind == "completion" and self.shape.echo and not c.started:
                text, lps = self._echo(c, text, lps)
            if self.with_logprobs:
                choice["logprobs"] = logprobs_json(kind, lps, c.offset)
            if kind == "completion" and self.shape.prompt_logprobs and not c.started:
                choice["prompt_logprobs"] = prompt_logprobs_json(c.prompt_logprobs)
            c.offset += sum(len(lp.token) for lp in lps) if self.with_logprobs else len(text)
        else:
            choice["finish_reason"] = ("length" if self.shape.drop_generated
                                       else r.complete.finish_reason)
            text = ""
        if kind == "chat":
            delta: dict[str, Any] = {} if r.HasField("complete") else {"content": text}
            if not c.started:
                delta["role"] = "assistant"
            choice["delta"] = delta
        else:
            choice["text"] = text
        c.started = True
        encoded = self._prefix + _encoder.encode(choice)
        if self.continuous:
            usage = usage_json([c], 1)
            return encoded + b'],"usage":' + _encoder.encode(usage) + b"}\n\n"
        return encoded + self._suffix

    def _tool_chunk(self, c: ChoiceState, r: pb.GenerateResponse) -> bytes:
        """A chat choice under tools: its text may be held and sent at the end as tool-call
        deltas (services/gateway/tool_calls.py); logprobs are not sent under tools."""
        assert self.shape.tools is not None
        stream = self._tool_streams.setdefault(c.index, ToolCallStream(self.shape.tools))
        done = r.HasField("complete")
        out = b""
        for delta, reason in stream_deltas(stream, None if done else r.chunk.text,
                                           r.complete.finish_reason if done else None):
            if not c.started:
                delta = {"role": "assistant", **delta}
            c.started = True
            choice = {"index": c.index, "logprobs": None, "finish_reason": reason,
                      "delta": delta}
            out += self._prefix + _encoder.encode(choice) + self._suffix
        return out

    def _echo(self, c: ChoiceState, text: str, lps: list[pb.TokenLogprob],
              ) -> tuple[str, list[pb.TokenLogprob]]:
        prompt = self.prompts[c.index // self.shape.n] if c.index // self.shape.n < len(
            self.prompts) else None
        echoed = prompt if prompt is not None else c.prompt_text
        return echoed + text, (list(c.prompt_logprobs) + lps) if self.with_logprobs else lps


def usage_event(h: Header, choices: list[ChoiceState], per_prompt: int) -> bytes:
    """The last event before [DONE] when `stream_options.include_usage` is set."""
    return sse({**h.fields(stream=True), "choices": [], "usage": usage_json(choices, per_prompt)})
