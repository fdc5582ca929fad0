"""Protobuf <-> plain Python at the service edge (slora_core never sees a `_pb2` type)."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from google.protobuf import json_format
from google.protobuf.internal.containers import RepeatedCompositeFieldContainer

from services.common import errors as e
from services.common.structured import template_tool_calls, template_tools
from slora.v1 import inference_pb2 as pb
from slora_core.sampling_params import SamplingParams

if TYPE_CHECKING:
    from slora_core.tokenizer import Tokenizer

DEFAULT_MAX_NEW_TOKENS = 64
_OPTIONAL = ("temperature", "top_p", "top_k", "repetition_penalty", "seed", "min_p",
             "presence_penalty", "frequency_penalty", "prompt_logprobs", "skip_special_tokens")


def sampling_kwargs(s: pb.SamplingOptions) -> dict[str, Any]:
    """Keyword arguments for `SamplingParams`; unset optional fields keep its defaults. With
    `fill_context` and no max_new_tokens, the default stands in until `fit_to_prompt` knows the
    prompt's length."""
    kwargs: dict[str, Any] = {
        "max_new_tokens": s.max_new_tokens or max(DEFAULT_MAX_NEW_TOKENS, s.min_new_tokens),
        "min_new_tokens": s.min_new_tokens,
        "stop": tuple(s.stop),
        "stop_token_ids": tuple(s.stop_token_ids),
        "ignore_eos": s.ignore_eos,
        "top_logprobs": s.top_logprobs,
        "logit_bias": tuple(sorted(s.logit_bias.items())),
        "include_stop_str_in_output": s.include_stop_str_in_output,
    }
    for name in _OPTIONAL:
        if s.HasField(name):
            kwargs[name] = getattr(s, name)
    return kwargs


def fit_to_prompt(params: SamplingParams, s: pb.SamplingOptions, prompt_tokens: int,
                  max_model_len: int, vocab_size: int) -> SamplingParams:
    """`params` once the prompt is known: `fill_context` without max_new_tokens generates up
    to the end of the context (OpenAI chat's default); logit_bias ids must be in the
    vocabulary (InvalidArgument naming logit_bias)."""
    for token, _ in params.logit_bias:
        if token >= vocab_size:
            raise e.InvalidArgument(f"logit_bias token id {token} is out of the vocabulary "
                                    f"(ids 0..{vocab_size - 1})")
    if s.fill_context and not s.max_new_tokens:
        room = max_model_len - prompt_tokens
        if room < 1:
            raise e.InvalidArgument(f"the prompt has {prompt_tokens} tokens, which leaves no "
                                    f"room to generate within max_model_len={max_model_len}")
        return dataclasses.replace(params, max_new_tokens=max(room, params.min_new_tokens))
    return params


def chat_messages(request: pb.GenerateRequest) -> list[dict[str, Any]]:
    """The chat as the template sees it (a message's `name`, tool calls and tool call id only
    when set)."""
    out = []
    for msg in request.messages:
        m: dict[str, Any] = {"role": msg.role, "content": msg.content}
        if msg.name:
            m["name"] = msg.name
        if msg.tool_calls_json:
            m["tool_calls"] = template_tool_calls(msg.tool_calls_json)
        if msg.tool_call_id:
            m["tool_call_id"] = msg.tool_call_id
        out.append(m)
    return out


def chat_options(request: pb.GenerateRequest) -> tuple[bool, dict[str, Any]]:
    """(add_generation_prompt, extra template variables) of a chat request."""
    add = request.add_generation_prompt if request.HasField("add_generation_prompt") else (
        not request.continue_final_message)
    kwargs = (json_format.MessageToDict(request.chat_template_kwargs)
              if request.HasField("chat_template_kwargs") else {})
    for reserved in ("messages", "add_generation_prompt"):
        kwargs.pop(reserved, None)
    if request.tools_json:
        kwargs["tools"] = template_tools(request.tools_json)
    return add, kwargs


def continue_final(rendered: str, final_content: str) -> str:
    """The rendered chat cut right after the last message's content (vLLM's
    continue_final_message): the model continues that message instead of closing it."""
    content = final_content.rstrip()
    at = rendered.rfind(content) if content else -1
    if at < 0:
        raise e.InvalidArgument("continue_final_message: the chat template does not show the "
                                "final message's content")
    return rendered[:at + len(content)]


def chat_prompt_ids(tokenizer: Tokenizer, request: pb.GenerateRequest) -> list[int]:
    """A chat request's prompt ids: the template over its messages (names included) with its
    options; raises ChatTemplateError or InvalidArgument."""
    messages = chat_messages(request)
    add, variables = chat_options(request)
    text = tokenizer.render_chat(messages, add, **variables)
    if request.continue_final_message:
        text = continue_final(text, messages[-1]["content"])
    return tokenizer.encode(text, add_special_tokens=False)


def first_chunk(chunk: pb.Chunk, request: pb.GenerateRequest, prompt_ids: Sequence[int],
                decode: Callable[[Sequence[int]], str],
                scores: Sequence[tuple[int, float, Sequence[tuple[int, float]]]] = (),
                text_of: Callable[[int], tuple[str, bytes]] | None = None) -> pb.Chunk:
    """`chunk` with what a call's first chunk carries: the prompt's length, its text when
    `return_prompt_text` (echo), and its tokens' logprobs when `prompt_logprobs` was asked
    (`scores`: positions 1, 2, ...; the first token, which nothing predicts, gets NaN)."""
    chunk.prompt_tokens = len(prompt_ids)
    if request.return_prompt_text:
        chunk.prompt_text = request.text if request.WhichOneof("input") == "text" else (
            decode(prompt_ids))
    if request.sampling.HasField("prompt_logprobs") and text_of is not None and prompt_ids:
        ids = [prompt_ids[0], *(t for t, _, _ in scores)]
        lps = [math.nan, *(lp for _, lp, _ in scores)]
        tops: list[Sequence[tuple[int, float]]] = [(), *(top for _, _, top in scores)]
        add_token_logprobs(chunk.prompt_logprobs, text_of, ids, lps, tops)
    return chunk


def add_token_logprobs(into: RepeatedCompositeFieldContainer[pb.TokenLogprob],
                       text_of: Callable[[int], tuple[str, bytes]],
                       token_ids: Sequence[int], logprobs: Sequence[float],
                       tops: Sequence[Sequence[tuple[int, float]]] | None = None) -> None:
    """Add a TokenLogprob a token, with its text and bytes (`text_of(id)`) and those of its
    alternatives (`tops`, none when None), to the repeated field `into`. Built in place: a
    message built apart and then added would be copied in (a few us a token)."""
    if tops is None:
        for tok, lp in zip(token_ids, logprobs, strict=True):
            text, raw = text_of(tok)
            into.add(token_id=tok, logprob=lp, token=text, token_bytes=raw)
        return
    for tok, lp, top in zip(token_ids, logprobs, tops, strict=True):
        text, raw = text_of(tok)
        entry = into.add(token_id=tok, logprob=lp, token=text, token_bytes=raw)
        for i, v in top:
            t, b = text_of(i)
            entry.top_logprobs.add(token_id=i, logprob=v, token=t, token_bytes=b)


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
