"""Structured output and tool calling on a real stack (control plane, CPU worker, gateway), with
the `openai` SDK (`chat.completions.parse` with a pydantic model), LangChain's
`with_structured_output`, raw HTTP and gRPC. The demo model is tiny and random: its outputs
parse because the grammar constrains them, with and without adapters."""

from __future__ import annotations

import json
import re
import time
from pathlib import Path
from typing import Any, Literal

import httpx
import jsonschema
import pytest
from openai import OpenAI
from pydantic import BaseModel, Field

from devtools.demo_stack import BASE_MODEL
from slora.v1 import inference_pb2 as pb
from tests.services.dataplane.dp_support import generate, request
from tests.services.dataplane.http_support import ADAPTERS, GRAMMAR_TIMEOUT_S, HttpStack

pytestmark = pytest.mark.timeout(600)
# The default suite keeps the SDK parse on the base model, the bad inputs and gRPC; the rest
# (adapters over HTTP, LangChain, the corpus slice, vLLM's spellings, tools) runs with -m slow.
SLOW = pytest.mark.slow
CORPUS = json.loads((Path(__file__).resolve().parents[2] / "data" / "json_schemas.json"
                     ).read_text())
MODELS = (BASE_MODEL, ADAPTERS[0])
CHAT = [{"role": "user", "content": "File a ticket for the login bug."}]
# Compiles in seconds (xgrammar expands optional properties pairwise): past the stack's limit.
# 1,200 properties took 1.9-4.3 s on the 2-core machine alone and once in a CI run compiled
# inside the 2 s limit; 1,500 took 6.8 s (the time grows ~n^3).
SLOW_SCHEMA = {"type": "object", "properties": {f"p{i}": {"type": "integer"}
                                                for i in range(1500)}}
TIMEOUT_S = GRAMMAR_TIMEOUT_S  # the shared stack's limit (tests/services/conftest.py)
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city.",
    "parameters": {"type": "object", "properties": {
        "city": {"type": "string", "maxLength": 10},
        "unit": {"enum": ["celsius", "fahrenheit"]}}, "required": ["city", "unit"]}}}


class Ticket(BaseModel):
    title: str = Field(max_length=12)
    priority: Literal["low", "medium", "high"]
    estimate: int = Field(ge=0, le=40)


@pytest.fixture(scope="module")
def hs(shared_http_stack: HttpStack) -> HttpStack:
    return shared_http_stack


@pytest.fixture(scope="module")
def client(hs: HttpStack) -> OpenAI:
    c = OpenAI(base_url=hs.url, api_key=hs.token, max_retries=0, timeout=120)
    # The first grammar builds the worker's grammar backend (imports, vocabulary): once.
    c.chat.completions.create(model=BASE_MODEL, messages=CHAT, max_tokens=8,
                              extra_body={"guided_choice": ["ok"]})
    return c


def _post(hs: HttpStack, body: dict[str, Any]) -> httpx.Response:
    return httpx.post(f"{hs.url}/chat/completions", json=body, timeout=120,
                      headers={"authorization": f"Bearer {hs.token}"})


@pytest.mark.parametrize("model", [BASE_MODEL, pytest.param(ADAPTERS[0], marks=SLOW)])
def test_openai_parse_with_a_pydantic_model(client: OpenAI, model: str) -> None:
    done = client.chat.completions.parse(model=model, messages=CHAT, response_format=Ticket,
                                         max_tokens=200, temperature=1.0, seed=3)
    parsed = done.choices[0].message.parsed
    assert isinstance(parsed, Ticket), done.choices[0].message.content
    assert done.choices[0].finish_reason == "stop"


# json_mode asks for any JSON object (the schema reaches no grammar): a random model need not
# close it within max_tokens, so it is left out here (json_object is tested below).
@SLOW
@pytest.mark.parametrize("method", ["json_schema", "function_calling"])
def test_langchain_with_structured_output(hs: HttpStack, client: OpenAI, method: str) -> None:
    from langchain_openai import ChatOpenAI

    llm = ChatOpenAI(model=ADAPTERS[0], base_url=hs.url, api_key=hs.token, max_tokens=200,
                     temperature=1.0, max_retries=0)
    result = llm.with_structured_output(Ticket, method=method).invoke(CHAT)
    assert isinstance(result, Ticket)


@SLOW
@pytest.mark.parametrize("model", MODELS)
def test_corpus_subset_validates_over_http(hs: HttpStack, model: str) -> None:
    """A fast slice of the corpus (the whole corpus runs on the engine: test_structured_engine)."""
    names = list(CORPUS)[::9]
    for name in names:
        schema = CORPUS[name]
        r = _post(hs, {"model": model, "messages": CHAT, "max_tokens": 300, "seed": 1,
                       "response_format": {"type": "json_schema",
                                           "json_schema": {"name": name, "schema": schema}}})
        assert r.status_code == 200, r.text
        content = r.json()["choices"][0]["message"]["content"]
        jsonschema.validate(json.loads(content), schema)


@SLOW
@pytest.mark.parametrize(("extra", "check"), [
    ({"guided_choice": ["red", "green"]}, lambda t: t in ("red", "green")),
    ({"structured_outputs": {"regex": r"[a-c]{3}-\d{2}"}},
     lambda t: re.fullmatch(r"[a-c]{3}-\d{2}", t)),
    ({"structured_outputs": {"grammar": 'root ::= "<" [0-9] ">"'}},
     lambda t: re.fullmatch(r"<\d>", t)),
    ({"guided_json": {"type": "object", "properties": {"n": {"type": "integer", "minimum": 1,
                                                              "maximum": 9}},
                      "required": ["n"]}}, lambda t: 1 <= json.loads(t)["n"] <= 9),
    ({"response_format": {"type": "json_object"}}, None),
])
def test_vllm_extras_and_old_names(client: OpenAI, extra: dict[str, Any], check: Any) -> None:
    if check is None:  # json_object: any object; the random model may not close it in budget
        done = client.chat.completions.create(model=ADAPTERS[0], messages=CHAT, max_tokens=40,
                                              extra_body=extra)
        text = done.choices[0].message.content or ""
        assert text.startswith("{")
        return
    done = client.chat.completions.create(model=ADAPTERS[0], messages=CHAT, max_tokens=60,
                                          extra_body=extra)
    assert check(done.choices[0].message.content), done.choices[0].message.content
    completion = client.completions.create(model=BASE_MODEL, prompt="Answer:", max_tokens=60,
                                           extra_body=extra)
    assert check(completion.choices[0].text), completion.choices[0].text


@pytest.mark.parametrize(("body", "param", "problem"), [
    ({"response_format": {"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"type": "objec"}}}}, None, 'Unsupported type "objec"'),
    ({"guided_json": {"description": "x" * 70_000}}, "guided_json", "past the limit"),
    ({"structured_outputs": {"regex": "(abc"}}, None, "regex refused"),
    ({"guided_json": SLOW_SCHEMA}, None, f"did not compile within {TIMEOUT_S:g} s"),
    ({"guided_grammar": "root ::= nothing"}, None, 'Rule "nothing" is not defined'),
])
def test_bad_constraints_are_400s_and_the_worker_keeps_serving(
        hs: HttpStack, client: OpenAI, body: dict[str, Any], param: str | None,
        problem: str) -> None:
    start = time.monotonic()
    r = _post(hs, {"model": ADAPTERS[0], "messages": CHAT, "max_tokens": 20, **body})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert problem in err["message"], err
    if param is not None:
        assert err["param"] == param
    assert time.monotonic() - start < TIMEOUT_S + 8
    ok = client.chat.completions.create(model=ADAPTERS[0], messages=CHAT, max_tokens=4)
    assert ok.choices[0].finish_reason in ("stop", "length")


@SLOW
def test_tool_choice_required_and_named(client: OpenAI) -> None:
    done = client.chat.completions.create(model=ADAPTERS[0], messages=CHAT, max_tokens=200,
                                          tools=[WEATHER], tool_choice="required", seed=2)
    choice = done.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.tool_calls
    for call in choice.message.tool_calls:
        assert call.function.name == "get_weather"
        jsonschema.validate(json.loads(call.function.arguments),
                            WEATHER["function"]["parameters"])
    named = client.chat.completions.create(
        model=BASE_MODEL, messages=CHAT, max_tokens=200, tools=[WEATHER],
        tool_choice={"type": "function", "function": {"name": "get_weather"}})
    call = named.choices[0].message.tool_calls[0]
    assert named.choices[0].finish_reason == "tool_calls" and call.id.startswith("call_")
    jsonschema.validate(json.loads(call.function.arguments), WEATHER["function"]["parameters"])
    # A follow-up turn with the call and its result renders and runs.
    follow = client.chat.completions.create(
        model=BASE_MODEL, max_tokens=8, tools=[WEATHER], messages=[
            *CHAT, {"role": "assistant", "content": None,
                    "tool_calls": [call.model_dump()]},
            {"role": "tool", "tool_call_id": call.id, "content": "sunny"}])
    assert follow.choices[0].finish_reason in ("stop", "length")


@SLOW
def test_tool_calls_stream_as_deltas(client: OpenAI) -> None:
    stream = client.chat.completions.create(model=ADAPTERS[0], messages=CHAT, max_tokens=200,
                                            tools=[WEATHER], tool_choice="required", stream=True)
    args: dict[int, str] = {}
    names: dict[int, str] = {}
    finish = None
    for chunk in stream:
        for choice in chunk.choices:
            for d in choice.delta.tool_calls or ():
                names[d.index] = names.get(d.index, "") + (d.function.name or "")
                args[d.index] = args.get(d.index, "") + (d.function.arguments or "")
            finish = choice.finish_reason or finish
    assert finish == "tool_calls" and names and set(names.values()) == {"get_weather"}
    for text in args.values():
        jsonschema.validate(json.loads(text), WEATHER["function"]["parameters"])


def test_grpc_generate_takes_the_proto_field(hs: HttpStack) -> None:
    req = request("Answer:", ADAPTERS[1], max_new_tokens=40)
    req.structured_output.CopyFrom(pb.StructuredOutput(regex=r"(yes|no)-[0-9]{2}"))
    res = generate(hs.grpc, req, hs.token)
    assert res.error is None, res.details
    assert re.fullmatch(r"(yes|no)-[0-9]{2}", res.text), res.text
    bad = request("Answer:", ADAPTERS[1], max_new_tokens=4)
    bad.structured_output.CopyFrom(pb.StructuredOutput(json_schema="{nope"))
    res = generate(hs.grpc, bad, hs.token)
    assert res.error is not None and "INVALID_ARGUMENT" in str(res.error), res.details
