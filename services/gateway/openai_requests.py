"""OpenAI Completions and Chat Completions request bodies, validated, and their conversion to
the `GenerateRequest`s the routing path forwards (one per prompt and sample).

What vLLM's OpenAI server accepts is accepted here, at the top level or inside a literal
`extra_body` object (where the `openai` client's `extra_body` lands is the top level already).
`null` means "the default" for every field. An unknown field is ignored, logged, and named in
the response's `x-slora-ignored-fields` header (vLLM's behaviour), never refused. Bad values
raise `FieldError`, which names the field as the caller spelt it (OpenAI's `param`).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from services.common import errors as e
from services.common.limits import DEFAULT_LIMITS
from services.gateway.constraints import apply_constraint
from services.gateway.tool_calls import ToolPlan, plan_chat
from slora.v1 import inference_pb2 as pb

log = logging.getLogger(__name__)

MAX_CALLS = DEFAULT_LIMITS.n  # prompts x best_of per HTTP request: each is one worker call
MAX_STOP = DEFAULT_LIMITS.stop_strings
MAX_LOGPROBS = DEFAULT_LIMITS.top_logprobs  # OpenAI's and vLLM's default limit: 20
COMPLETIONS_DEFAULT_MAX_TOKENS = 16  # OpenAI's and vLLM's default for /v1/completions
MAX_LOGIT_BIAS = 100.0


class FieldError(e.InvalidArgument):
    """A bad value in a request body; `param` is the field as the caller named it."""

    def __init__(self, param: str | None, message: str, code: str = "invalid_value") -> None:
        super().__init__(message)
        self.param, self.openai_code = param, code


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="ignore")
    include_usage: bool | None = None
    continuous_usage_stats: bool | None = None


class _Common(BaseModel):
    """Fields shared by both endpoints (vLLM's sampling extras included)."""

    model_config = ConfigDict(extra="allow")
    model: str
    max_tokens: int | None = Field(default=None, ge=0)
    max_completion_tokens: int | None = Field(default=None, ge=0)
    temperature: float | None = Field(default=None, ge=0.0, le=2.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    n: int | None = Field(default=None, ge=1)
    best_of: int | None = Field(default=None, ge=1)
    stream: bool | None = None
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    seed: int | None = Field(default=None, ge=-(2**63), lt=2**64)
    presence_penalty: float | None = Field(default=None, ge=-2.0, le=2.0)
    frequency_penalty: float | None = Field(default=None, ge=-2.0, le=2.0)
    logit_bias: dict[str, float] | None = None
    user: str | None = None
    # Accepted without effect on generation (the caller's own records, OpenAI's billing).
    metadata: dict[str, Any] | None = None
    service_tier: str | None = None
    store: bool | None = None
    # vLLM's extras
    top_k: int | None = Field(default=None, ge=-1)
    min_p: float | None = Field(default=None, ge=0.0, le=1.0)
    repetition_penalty: float | None = Field(default=None, gt=0.0)
    min_tokens: int | None = Field(default=None, ge=0)
    stop_token_ids: list[int] | None = None
    ignore_eos: bool | None = None
    include_stop_str_in_output: bool | None = None
    skip_special_tokens: bool | None = None
    spaces_between_special_tokens: bool | None = None
    prompt_logprobs: int | None = Field(default=None, ge=-1)
    # Structured output (services/gateway/constraints.py checks them)
    response_format: Any = None
    structured_outputs: Any = None
    guided_json: Any = None
    guided_regex: Any = None
    guided_choice: Any = None
    guided_grammar: Any = None
    guided_decoding_backend: str | None = None  # accepted; the backend is the server's choice
    # slora's own
    adapter_version: str | None = None
    routing_key: str | None = None


class CompletionRequest(_Common):
    prompt: str | list[int] | list[str] | list[list[int]]
    logprobs: int | None = Field(default=None, ge=0)
    echo: bool | None = None
    suffix: str | None = None


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")  # tool_calls, refusal...: ignored unless set
    role: str
    content: str | list[dict[str, Any]] | None = None
    name: str | None = None


class ChatCompletionRequest(_Common):
    messages: list[ChatMessage] = Field(min_length=1)
    logprobs: bool | None = None
    top_logprobs: int | None = Field(default=None, ge=0)
    tools: list[dict[str, Any]] | None = None
    tool_choice: Any = None
    parallel_tool_calls: bool | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    add_generation_prompt: bool | None = None
    continue_final_message: bool | None = None


Kind = Literal["completion", "chat"]


@dataclass(frozen=True)
class Plan:
    """What one HTTP request becomes: `calls[i]` serves sample i % best_of of prompt
    i // best_of; the response keeps `n` of each prompt's `best_of` (the most likely)."""

    calls: list[pb.GenerateRequest]
    top_logprobs: int | None  # None: no logprobs in the response
    n: int = 1
    best_of: int = 1
    echo: bool = False
    prompt_logprobs: int | None = None
    prompts: list[str | None] = field(default_factory=list)  # text prompts, for echo
    # echo with max_tokens 0: the workers generate one token, which the response leaves out
    drop_generated: bool = False
    # Internal field names -> what this caller sent (for the errors the workers raise).
    names: dict[str, str] = field(default_factory=dict)
    tools: ToolPlan | None = None  # chat tools: how the output becomes tool_calls


def parse(model: type[_Common], body: Any) -> tuple[Any, list[str]]:
    """The validated request and the unknown fields it carried (ignored, logged)."""
    if not isinstance(body, dict):
        raise FieldError(None, "the body must be a JSON object")
    extra_body = body.get("extra_body")
    if isinstance(extra_body, dict):  # a client that sent extra_body literally
        body = {**extra_body, **{k: v for k, v in body.items() if k != "extra_body"}}
    try:
        req = model.model_validate(body)
    except ValidationError as exc:
        first = exc.errors()[0]
        param = ".".join(str(p) for p in first["loc"]) or None
        problems = "; ".join(f"{'.'.join(str(p) for p in err['loc']) or 'body'}: {err['msg']}"
                             for err in exc.errors())
        raise FieldError(param, problems) from None
    unknown = sorted(req.model_extra or {})
    for i, m in enumerate(getattr(req, "messages", ())):
        unknown += [f"messages[{i}].{k}" for k, v in (m.model_extra or {}).items()
                    if v is not None and k not in ("tool_calls", "tool_call_id", "refusal")]
    if unknown:
        log.warning("ignored fields in a %s request: %s", model.__name__, ", ".join(unknown))
    return req, unknown


def _check_common(req: _Common) -> None:
    if req.stream_options is not None and not req.stream:
        raise FieldError("stream_options", "stream_options is only allowed with stream=true")
    if req.max_tokens is not None and req.max_completion_tokens is not None:
        raise FieldError("max_tokens", "give max_tokens or max_completion_tokens, not both")
    for name, value in (req.logit_bias or {}).items():
        try:
            token = int(name)
        except ValueError:
            raise FieldError("logit_bias", f"logit_bias keys must be token ids, got {name!r}"
                             ) from None
        if token < 0:
            raise FieldError("logit_bias", f"logit_bias token id {token} is out of the vocabulary")
        if not -MAX_LOGIT_BIAS <= value <= MAX_LOGIT_BIAS:
            raise FieldError("logit_bias", f"logit_bias values must be in [-100, 100], got "
                             f"{value} for token {token}")
    if req.prompt_logprobs is not None and req.prompt_logprobs > MAX_LOGPROBS:
        raise FieldError("prompt_logprobs", f"prompt_logprobs is {req.prompt_logprobs}; "
                         f"allowed 0..{MAX_LOGPROBS} (-1 is not supported)")
    if req.prompt_logprobs is not None and req.prompt_logprobs < 0:
        raise FieldError("prompt_logprobs", "prompt_logprobs -1 (the whole vocabulary) is not "
                         f"supported; allowed 0..{MAX_LOGPROBS}")
    for t in req.stop_token_ids or ():
        if t < 0:
            raise FieldError("stop_token_ids", f"stop_token_ids holds {t}: ids are >= 0")


def _max_tokens_name(req: _Common) -> str:
    return "max_completion_tokens" if req.max_completion_tokens is not None else "max_tokens"


def _sampling(req: _Common, max_tokens: int | None, top_logprobs: int | None,
              ) -> pb.SamplingOptions:
    stops = [req.stop] if isinstance(req.stop, str) else list(req.stop or [])
    if len(stops) > MAX_STOP:
        raise FieldError("stop", f"at most {MAX_STOP} stop sequences, got {len(stops)}")
    if any(not s for s in stops):
        raise FieldError("stop", "stop sequences must not be empty")
    opts = pb.SamplingOptions(
        max_new_tokens=max_tokens or 0, fill_context=max_tokens is None, stop=stops,
        ignore_eos=bool(req.ignore_eos), min_new_tokens=req.min_tokens or 0,
        top_logprobs=top_logprobs or 0, stop_token_ids=req.stop_token_ids or [],
        include_stop_str_in_output=bool(req.include_stop_str_in_output),
        logit_bias={int(k): v for k, v in (req.logit_bias or {}).items()})
    for name in ("temperature", "top_p", "repetition_penalty", "min_p", "presence_penalty",
                 "frequency_penalty", "skip_special_tokens", "prompt_logprobs"):
        value = getattr(req, name)
        if value is not None:
            setattr(opts, name, value)
    if req.top_k is not None and req.top_k > 0:  # vLLM: -1 and 0 both mean off
        opts.top_k = req.top_k
    if req.seed is not None:
        opts.seed = req.seed % 2**64  # vLLM takes negative seeds; one generator state each
    return opts


def _adapter(model: str, base_model: str, version: str | None) -> pb.AdapterRef:
    if model == base_model:
        if version is not None:
            raise FieldError("adapter_version", f"adapter_version names a version of an "
                             f"adapter; {model!r} is the base model")
        return pb.AdapterRef()
    ref = pb.AdapterRef(adapter_id=model)
    if version is not None:
        ref.version = version
    return ref


def _samples(req: _Common) -> tuple[int, int]:
    """(n, best_of) checked: best_of >= n, no streaming with best_of > n (as vLLM)."""
    n = req.n or 1
    best_of = req.best_of or n
    if best_of < n:
        raise FieldError("best_of", f"best_of ({best_of}) must be >= n ({n})")
    if best_of > n and req.stream:
        raise FieldError("best_of", "best_of > n cannot be streamed (the best are known at "
                         "the end)")
    if best_of > MAX_CALLS:
        raise FieldError("n" if req.best_of is None else "best_of",
                         f"n is {best_of}; allowed 1..{MAX_CALLS}" if req.best_of is None
                         else f"best_of is {best_of}; allowed 1..{MAX_CALLS}")
    return n, best_of


def _calls(req: _Common, inputs: list[pb.GenerateRequest], base_model: str,
           sampling: pb.SamplingOptions, request_id: str, best_of: int,
           ) -> list[pb.GenerateRequest]:
    total = len(inputs) * best_of
    if total > MAX_CALLS:
        raise FieldError("prompt", f"prompts x n may be at most {MAX_CALLS} per request, got "
                         f"{len(inputs)} x {best_of}")
    adapter = _adapter(req.model, base_model, req.adapter_version)
    # Every choice of one request lands on the same version: one routing key for all of them.
    key = req.routing_key or req.user or request_id
    calls = []
    for i in range(total):
        call = pb.GenerateRequest()
        call.CopyFrom(inputs[i // best_of])
        call.request_id = request_id if total == 1 else f"{request_id}-{i}"
        call.adapter.CopyFrom(adapter)
        call.sampling.CopyFrom(sampling)
        if sampling.HasField("seed") and i % best_of:
            call.sampling.seed = (sampling.seed + i % best_of) % 2**64  # seeded samples differ
        call.routing_key = key
        calls.append(call)
    return calls


def _names(req: _Common, logprobs_name: str, prompt_name: str) -> dict[str, str]:
    return {"max_new_tokens": _max_tokens_name(req), "min_new_tokens": "min_tokens",
            "top_logprobs": logprobs_name, "@prompt": prompt_name}


def completion_plan(req: CompletionRequest, base_model: str, request_id: str) -> Plan:
    _check_common(req)
    if req.suffix:
        raise FieldError("suffix", "suffix is not supported")
    if req.logprobs is not None and req.logprobs > MAX_LOGPROBS:
        raise FieldError("logprobs", f"logprobs is {req.logprobs}; allowed 0..{MAX_LOGPROBS}")
    n, best_of = _samples(req)
    prompts: list[str] | list[list[int]]
    p = req.prompt
    if isinstance(p, str):
        prompts = [p]
    elif p and isinstance(p[0], int):
        prompts = [p]  # type: ignore[list-item]
    else:
        prompts = p  # type: ignore[assignment]
    if not prompts or any(len(x) == 0 for x in prompts):
        raise FieldError("prompt", "prompt must not be empty")
    echo = bool(req.echo)
    inputs = [pb.GenerateRequest(text=x, return_prompt_text=echo) if isinstance(x, str)
              else pb.GenerateRequest(token_ids=pb.TokenIds(ids=x), return_prompt_text=echo)
              for x in prompts]
    limit = req.max_completion_tokens if req.max_tokens is None else req.max_tokens
    if limit == 0 and not echo:
        raise FieldError(_max_tokens_name(req), f"{_max_tokens_name(req)} must be at least 1 "
                         "(0 only with echo, for the prompt's logprobs)")
    sampling = _sampling(req, COMPLETIONS_DEFAULT_MAX_TOKENS if limit is None else limit or 1,
                         req.logprobs)
    if echo and req.logprobs is not None and not sampling.HasField("prompt_logprobs"):
        sampling.prompt_logprobs = req.logprobs  # echo + logprobs: the prompt's too
    calls = _calls(req, inputs, base_model, sampling, request_id, best_of)
    apply_constraint(req, calls)
    return Plan(calls, req.logprobs, n, best_of, echo,
                sampling.prompt_logprobs if sampling.HasField("prompt_logprobs") else None,
                [x if isinstance(x, str) else None for x in prompts],
                names=_names(req, "logprobs", "prompt"), drop_generated=limit == 0)


def chat_plan(req: ChatCompletionRequest, base_model: str, request_id: str) -> Plan:
    _check_common(req)
    if req.top_logprobs is not None and not req.logprobs:
        raise FieldError("top_logprobs", "top_logprobs needs logprobs=true")
    if req.top_logprobs is not None and req.top_logprobs > MAX_LOGPROBS:
        raise FieldError("top_logprobs", f"top_logprobs is {req.top_logprobs}; allowed "
                         f"0..{MAX_LOGPROBS}")
    if req.continue_final_message and req.add_generation_prompt:
        raise FieldError("continue_final_message", "continue_final_message needs "
                         "add_generation_prompt=false")
    n, best_of = _samples(req)
    chat = pb.GenerateRequest(messages=[_message(i, m) for i, m in enumerate(req.messages)],
                              continue_final_message=bool(req.continue_final_message))
    if req.add_generation_prompt is not None:
        chat.add_generation_prompt = req.add_generation_prompt
    elif req.continue_final_message:
        chat.add_generation_prompt = False
    if req.chat_template_kwargs:
        try:
            chat.chat_template_kwargs.update(req.chat_template_kwargs)
        except (ValueError, TypeError) as exc:
            raise FieldError("chat_template_kwargs", f"chat_template_kwargs: {exc}") from None
    top = (req.top_logprobs or 0) if req.logprobs else None
    limit = req.max_completion_tokens if req.max_tokens is None else req.max_tokens
    if limit == 0:
        raise FieldError(_max_tokens_name(req), f"{_max_tokens_name(req)} must be at least 1")
    sampling = _sampling(req, limit, top)
    tools = plan_chat(req, chat)
    calls = _calls(req, [chat], base_model, sampling, request_id, best_of)
    return Plan(calls, top, n, best_of, names=_names(req, "top_logprobs", "messages"),
                tools=tools)


def _message(index: int, m: ChatMessage) -> pb.ChatMessage:
    name = m.name or ""
    if isinstance(m.content, list):
        texts = []
        for part in m.content:
            if part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise FieldError(f"messages[{index}].content", f"messages[{index}]: only text "
                                 f"content parts are supported, got {part.get('type')!r}")
            texts.append(part["text"])
        return pb.ChatMessage(role=m.role, content="".join(texts), name=name)
    return pb.ChatMessage(role=m.role, content=m.content or "", name=name)
