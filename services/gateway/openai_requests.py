"""OpenAI Completions and Chat Completions request bodies, validated, and their conversion to
the `GenerateRequest`s the routing path forwards (one per prompt and sample).

Unknown fields are refused (a misspelt `max_token` must not be ignored); OpenAI fields slora
does not implement are refused with a message saying so, unless they hold their neutral value.
slora's own fields (`adapter_version`, `routing_key`, `min_tokens`, `repetition_penalty`,
`ignore_eos`, `top_k`) come at the top level, which is where the `openai` client's
`extra_body` puts them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from services.common import errors as e
from services.common.limits import DEFAULT_LIMITS, check_n
from slora.v1 import inference_pb2 as pb

MAX_CALLS = DEFAULT_LIMITS.n  # prompts x n per HTTP request: each is one worker call
MAX_STOP = 4             # OpenAI's limit on stop sequences
COMPLETIONS_DEFAULT_MAX_TOKENS = 16  # OpenAI's default for /v1/completions


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")
    include_usage: bool = False


class _Common(BaseModel):
    """Fields shared by both endpoints."""

    model_config = ConfigDict(extra="forbid")
    model: str
    max_tokens: int | None = Field(default=None, ge=1)
    temperature: float | None = Field(default=None, ge=0.0, le=2.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    n: int = Field(default=1, ge=1)
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    seed: int | None = Field(default=None, ge=0, lt=2**64)
    presence_penalty: float | None = Field(default=None, ge=-2.0, le=2.0)
    frequency_penalty: float | None = Field(default=None, ge=-2.0, le=2.0)
    logit_bias: dict[str, float] | None = None
    user: str | None = None
    # slora's extensions (extra_body)
    adapter_version: str | None = None
    routing_key: str | None = None
    top_k: int | None = Field(default=None, ge=0)
    min_tokens: int | None = Field(default=None, ge=0)
    repetition_penalty: float | None = Field(default=None, gt=0.0)
    ignore_eos: bool = False


class CompletionRequest(_Common):
    prompt: str | list[int] | list[str] | list[list[int]]
    logprobs: int | None = Field(default=None, ge=0, le=20)
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = None


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")  # name, tool_call_id...: refused below if set
    role: str
    content: str | list[dict[str, Any]] | None = None


class ChatCompletionRequest(_Common):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=20)
    tools: list[dict[str, Any]] | None = None
    tool_choice: Any = None
    response_format: dict[str, Any] | None = None
    # Accepted and without effect on generation: metadata for the caller's own records.
    metadata: dict[str, str] | None = None
    store: bool | None = None
    parallel_tool_calls: bool | None = None


@dataclass(frozen=True)
class Plan:
    """What one HTTP request becomes: `calls[i]` serves choice i (prompt i // n, sample i % n)."""

    calls: list[pb.GenerateRequest]
    top_logprobs: int | None  # None: no logprobs in the response


def _refuse_unsupported(req: _Common) -> None:
    for name in ("presence_penalty", "frequency_penalty"):
        if getattr(req, name):
            raise e.InvalidArgument(f"{name} is not supported (use repetition_penalty in "
                                    "extra_body)")
    if req.logit_bias:
        raise e.InvalidArgument("logit_bias is not supported")
    if req.stream_options is not None and not req.stream:
        raise e.InvalidArgument("stream_options is only allowed with stream=true")


def _sampling(req: _Common, max_tokens: int | None, top_logprobs: int | None,
              ) -> pb.SamplingOptions:
    stops = [req.stop] if isinstance(req.stop, str) else list(req.stop or [])
    if len(stops) > MAX_STOP:
        raise e.InvalidArgument(f"at most {MAX_STOP} stop sequences, got {len(stops)}")
    opts = pb.SamplingOptions(max_new_tokens=max_tokens or 0, stop=stops,
                              ignore_eos=req.ignore_eos, min_new_tokens=req.min_tokens or 0,
                              top_logprobs=top_logprobs or 0)
    for name in ("temperature", "top_p", "top_k", "repetition_penalty", "seed"):
        value = getattr(req, name)
        if value is not None:
            setattr(opts, name, value)
    return opts


def _adapter(model: str, base_model: str, version: str | None) -> pb.AdapterRef:
    if model == base_model:
        if version is not None:
            raise e.InvalidArgument(f"adapter_version names a version of an adapter; "
                                    f"{model!r} is the base model")
        return pb.AdapterRef()
    ref = pb.AdapterRef(adapter_id=model)
    if version is not None:
        ref.version = version
    return ref


def _calls(req: _Common, inputs: list[pb.GenerateRequest], base_model: str,
           sampling: pb.SamplingOptions, request_id: str) -> list[pb.GenerateRequest]:
    check_n(req.n)
    total = len(inputs) * req.n
    if total > MAX_CALLS:
        raise e.InvalidArgument(f"prompts x n may be at most {MAX_CALLS} per request, got "
                                f"{len(inputs)} x {req.n}")
    adapter = _adapter(req.model, base_model, req.adapter_version)
    # Every choice of one request lands on the same version: one routing key for all of them.
    key = req.routing_key or req.user or request_id
    calls = []
    for i in range(total):
        call = pb.GenerateRequest()
        call.CopyFrom(inputs[i // req.n])
        call.request_id = request_id if total == 1 else f"{request_id}-{i}"
        call.adapter.CopyFrom(adapter)
        call.sampling.CopyFrom(sampling)
        if req.seed is not None and i % req.n:
            call.sampling.seed = (req.seed + i % req.n) % 2**64  # n seeded samples differ
        call.routing_key = key
        calls.append(call)
    return calls


def completion_plan(req: CompletionRequest, base_model: str, request_id: str) -> Plan:
    _refuse_unsupported(req)
    if req.echo:
        raise e.InvalidArgument("echo is not supported")
    if req.suffix:
        raise e.InvalidArgument("suffix is not supported")
    if req.best_of not in (None, 1, req.n):
        raise e.InvalidArgument("best_of is not supported (only best_of = n)")
    prompts: list[str] | list[list[int]]
    p = req.prompt
    if isinstance(p, str):
        prompts = [p]
    elif p and isinstance(p[0], int):
        prompts = [p]  # type: ignore[list-item]
    else:
        prompts = p  # type: ignore[assignment]
    if not prompts or any(len(x) == 0 for x in prompts):
        raise e.InvalidArgument("prompt must not be empty")
    inputs = [pb.GenerateRequest(text=x) if isinstance(x, str)
              else pb.GenerateRequest(token_ids=pb.TokenIds(ids=x)) for x in prompts]
    sampling = _sampling(req, req.max_tokens or COMPLETIONS_DEFAULT_MAX_TOKENS, req.logprobs)
    return Plan(_calls(req, inputs, base_model, sampling, request_id), req.logprobs)


def chat_plan(req: ChatCompletionRequest, base_model: str, request_id: str) -> Plan:
    _refuse_unsupported(req)
    if req.tools or req.tool_choice not in (None, "none"):
        raise e.InvalidArgument("tools are not supported")
    if req.response_format and req.response_format.get("type") != "text":
        raise e.InvalidArgument("response_format other than text is not supported")
    if req.top_logprobs is not None and not req.logprobs:
        raise e.InvalidArgument("top_logprobs needs logprobs=true")
    if req.max_tokens and req.max_completion_tokens:
        raise e.InvalidArgument("give max_tokens or max_completion_tokens, not both")
    chat = pb.GenerateRequest(messages=[_message(i, m) for i, m in enumerate(req.messages)])
    top = (req.top_logprobs or 0) if req.logprobs else None
    sampling = _sampling(req, req.max_completion_tokens or req.max_tokens, top)
    return Plan(_calls(req, [chat], base_model, sampling, request_id), top)


def _message(index: int, m: ChatMessage) -> pb.ChatMessage:
    extra = sorted(k for k, v in (m.model_extra or {}).items() if v is not None)
    if extra:
        raise e.InvalidArgument(f"messages[{index}]: {', '.join(extra)} not supported")
    if isinstance(m.content, list):
        texts = []
        for part in m.content:
            if part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise e.InvalidArgument(f"messages[{index}]: only text content parts are "
                                        f"supported, got {part.get('type')!r}")
            texts.append(part["text"])
        return pb.ChatMessage(role=m.role, content="".join(texts))
    return pb.ChatMessage(role=m.role, content=m.content or "")
