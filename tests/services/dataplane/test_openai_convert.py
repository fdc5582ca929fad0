"""The OpenAI request conversion without a stack: what the gateway accepts and ignores, what it
names in errors, and what the worker does with chat names, template variables, fill-context
and logit_bias."""

from __future__ import annotations

import pytest
import tokenizers
from tokenizers import models, pre_tokenizers

from services.common import errors as e
from services.common.convert import chat_prompt_ids, fit_to_prompt, sampling_kwargs
from services.gateway.openai_requests import (
    ChatCompletionRequest,
    CompletionRequest,
    FieldError,
    chat_plan,
    completion_plan,
    parse,
)
from services.gateway.openai_responses import error_body
from slora.v1 import inference_pb2 as pb
from slora_core.chat_template import ChatTemplate
from slora_core.sampling_params import SamplingParams
from slora_core.tokenizer import Tokenizer

TEMPLATE = ("{% for m in messages %}<{{ m.role }}{% if m.name %}:{{ m.name }}{% endif %}>"
            "{{ m.content }}</>{% endfor %}{% if add_generation_prompt %}<assistant>{% endif %}"
            "{% if mood %}[{{ mood }}]{% endif %}")


def tokenizer() -> Tokenizer:
    vocab = {chr(c): i for i, c in enumerate(range(32, 127))}
    backend = tokenizers.Tokenizer(models.WordLevel(vocab, unk_token="?"))
    backend.pre_tokenizer = pre_tokenizers.Split("", "isolated")
    return Tokenizer(backend, None, [], chat_template=ChatTemplate(TEMPLATE))


def rendered(request: pb.GenerateRequest) -> str:
    tok = tokenizer()
    return "".join(tok.backend.id_to_token(i) for i in chat_prompt_ids(tok, request))


def test_names_options_and_template_variables_reach_the_template() -> None:
    body = {"model": "m", "messages": [{"role": "user", "content": "hi", "name": "alice"},
                                       {"role": "assistant", "content": "he"}],
            "chat_template_kwargs": {"mood": "calm"}, "add_generation_prompt": False,
            "continue_final_message": True, "max_tokens": 3}
    req, ignored = parse(ChatCompletionRequest, body)
    call = chat_plan(req, "base", "r").calls[0]
    assert ignored == []
    assert rendered(call) == "<user:alice>hi</><assistant>he"  # left open to continue
    call.continue_final_message = False
    call.add_generation_prompt = True
    assert rendered(call) == "<user:alice>hi</><assistant>he</><assistant>[calm]"


def test_nulls_unknown_fields_and_a_literal_extra_body() -> None:
    body = {"model": "m", "prompt": "x", "n": None, "stream": None, "logprobs": None,
            "echo": None, "temperature": None, "frobnicate": 1,
            "extra_body": {"top_k": 5, "min_p": 0.1, "wibble": True}}
    req, ignored = parse(CompletionRequest, body)
    assert ignored == ["frobnicate", "wibble"]
    plan = completion_plan(req, "base", "r")
    s = plan.calls[0].sampling
    assert (plan.n, plan.best_of, s.top_k, round(s.min_p, 6), s.max_new_tokens) == (1, 1, 5, 0.1, 16)
    assert not s.HasField("temperature") and not s.fill_context


def test_chat_without_max_tokens_fills_the_context() -> None:
    req, _ = parse(ChatCompletionRequest, {"model": "m", "messages": [
        {"role": "user", "content": "x"}], "min_tokens": 100})
    s = chat_plan(req, "base", "r").calls[0].sampling
    assert s.fill_context and s.max_new_tokens == 0
    params = SamplingParams(**sampling_kwargs(s))
    assert fit_to_prompt(params, s, 10, 512, 1000).max_new_tokens == 502
    with pytest.raises(e.InvalidArgument, match="no room to generate"):
        fit_to_prompt(params, s, 512, 512, 1000)


def test_sampling_extras_cross_the_proto_and_logit_bias_must_be_in_the_vocabulary() -> None:
    req, _ = parse(CompletionRequest, {
        "model": "m", "prompt": "x", "presence_penalty": 0.5, "frequency_penalty": -0.5,
        "logit_bias": {"7": -100, "3": 2.5}, "stop_token_ids": [9], "seed": -1,
        "include_stop_str_in_output": True, "skip_special_tokens": False, "prompt_logprobs": 2})
    s = completion_plan(req, "base", "r").calls[0].sampling
    p = SamplingParams(**sampling_kwargs(s))
    assert (p.presence_penalty, p.frequency_penalty, p.logit_bias) == (0.5, -0.5,
                                                                      ((3, 2.5), (7, -100.0)))
    assert (p.stop_token_ids, p.seed, p.include_stop_str_in_output, p.skip_special_tokens,
            p.prompt_logprobs) == ((9,), 2**64 - 1, True, False, 2)
    with pytest.raises(e.InvalidArgument, match="logit_bias token id 7 is out of the vocab"):
        fit_to_prompt(p, s, 1, 512, 7)


@pytest.mark.parametrize(("body", "param"), [
    ({"max_tokens": -1}, "max_tokens"),
    ({"logit_bias": {"1": 100.5}}, "logit_bias"),
    ({"logprobs": 21}, "logprobs"),
    ({"n": 2, "best_of": 1}, "best_of"),
    ({"stop_token_ids": [-1]}, "stop_token_ids"),
])
def test_field_errors_name_the_field(body: dict, param: str) -> None:
    with pytest.raises(FieldError) as err:
        req, _ = parse(CompletionRequest, {"model": "m", "prompt": "x", **body})
        completion_plan(req, "base", "r")
    assert err.value.param == param
    assert error_body(err.value)["error"]["param"] == param


def test_worker_messages_are_told_in_the_callers_words() -> None:
    names = {"max_new_tokens": "max_completion_tokens", "min_new_tokens": "min_tokens",
             "@prompt": "messages"}
    body = error_body(e.InvalidArgument("min_new_tokens must be >= 0 and <= 8, got 9"), names)
    assert body["error"] == {"message": "min_tokens must be >= 0 and <= 8, got 9",
                             "type": "invalid_request_error", "param": "min_tokens",
                             "code": "invalid_value"}
    over = error_body(e.InvalidArgument("prompt (600 tokens) + max_new_tokens (1) exceeds the "
                                        "context length max_model_len=512"), names)["error"]
    assert (over["param"], over["code"]) == ("messages", "context_length_exceeded")
    assert "max_completion_tokens (1)" in over["message"]
    missing = error_body(e.NotFound("unknown adapter 'x'"))["error"]
    assert (missing["type"], missing["code"]) == ("not_found_error", "model_not_found")
