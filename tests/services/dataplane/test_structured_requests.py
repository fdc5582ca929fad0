"""Structured output and tools as HTTP clients spell them: every spelling maps to one constraint
(or a 400 naming the field), and model output parses into OpenAI tool calls."""

from __future__ import annotations

import json

import pytest

from services.common import errors as e
from services.common.structured import from_pb, to_pb
from services.gateway.constraints import ConstraintError, constraint_of
from services.gateway.tool_calls import (
    ToolCallStream,
    ToolError,
    message_of,
    parse_auto,
    tool_plan,
)
from slora_core.structured.spec import MAX_SPEC_BYTES, StructuredOutput

SCHEMA = {"type": "object", "properties": {"x": {"type": "integer"}}, "required": ["x"]}
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                   "required": ["city"]}}}
TIME = {"type": "function", "function": {"name": "get_time"}}


@pytest.mark.parametrize(("fields", "expected"), [
    ({"response_format": {"type": "text"}}, None),
    ({"response_format": {"type": "json_object"}}, StructuredOutput("json_object")),
    ({"response_format": {"type": "json_schema",
                          "json_schema": {"name": "x", "schema": SCHEMA, "strict": True}}},
     StructuredOutput.json_schema(SCHEMA)),
    ({"structured_outputs": {"json": SCHEMA}}, StructuredOutput.json_schema(SCHEMA)),
    ({"structured_outputs": {"json": json.dumps(SCHEMA)}}, StructuredOutput.json_schema(SCHEMA)),
    ({"structured_outputs": {"regex": "[a-z]+"}}, StructuredOutput("regex", "[a-z]+")),
    ({"structured_outputs": {"choice": ["a", "b"]}}, StructuredOutput.choice(["a", "b"])),
    ({"structured_outputs": {"grammar": 'root ::= "x"'}},
     StructuredOutput("grammar", 'root ::= "x"')),
    ({"structured_outputs": {"json_object": True}}, StructuredOutput("json_object")),
    ({"guided_json": SCHEMA}, StructuredOutput.json_schema(SCHEMA)),
    ({"guided_regex": "a|b"}, StructuredOutput("regex", "a|b")),
    ({"guided_choice": ["yes", "no"]}, StructuredOutput.choice(["yes", "no"])),
    ({"guided_grammar": 'root ::= "y"'}, StructuredOutput("grammar", 'root ::= "y"')),
    ({}, None),
])
def test_every_spelling_maps_to_its_constraint(fields: dict, expected: StructuredOutput | None
                                                ) -> None:
    spec = constraint_of(fields)
    assert spec == expected
    if spec is not None:
        assert from_pb(to_pb(spec)) == spec  # and it crosses the wire unchanged


@pytest.mark.parametrize(("fields", "param", "problem"), [
    ({"response_format": {"type": "json_schema"}}, "response_format.json_schema", "needs a"),
    ({"response_format": {"type": "yaml"}}, "response_format.type", "not supported"),
    ({"guided_json": SCHEMA, "guided_regex": "a"}, "guided_regex", "give one"),
    ({"response_format": {"type": "json_object"}, "guided_choice": ["a"]}, "guided_choice",
     "give one"),
    ({"structured_outputs": {"regex": "a", "choice": ["a"]}}, "structured_outputs", "one"),
    ({"structured_outputs": {"structural_tag": "{}"}}, "structured_outputs", "structural_tag"),
    ({"guided_choice": []}, "guided_choice", "non-empty list"),
    ({"guided_json": "{not json"}, "guided_json", "not valid JSON"),
    ({"guided_json": {"description": "x" * MAX_SPEC_BYTES}}, "guided_json", "past the limit"),
])
def test_bad_constraints_name_the_field(fields: dict, param: str, problem: str) -> None:
    with pytest.raises(ConstraintError, match=problem) as info:
        constraint_of(fields)
    assert info.value.param == param and isinstance(info.value, e.InvalidArgument)


def test_tool_plans() -> None:
    assert tool_plan(None, None, None) is None
    assert tool_plan([WEATHER], "none", None) is None
    auto = tool_plan([WEATHER, TIME], None, None)
    assert auto is not None and auto.mode == "auto" and auto.constraint is None
    assert json.loads(auto.tools_json)[1]["function"]["parameters"] == {
        "type": "object", "properties": {}}
    named = tool_plan([WEATHER, TIME], {"type": "function", "function": {"name": "get_weather"}},
                      None)
    assert named is not None and named.constraint == StructuredOutput.json_schema(
        WEATHER["function"]["parameters"])
    required = tool_plan([WEATHER, TIME], "required", False)
    assert required is not None and required.constraint is not None
    schema = required.constraint.schema()
    assert schema["maxItems"] == 1 and len(schema["items"]["anyOf"]) == 2


@pytest.mark.parametrize(("tools", "choice", "param"), [
    ([{"type": "code_interpreter"}], None, "tools[0]"),
    ([{"type": "function", "function": {}}], None, "tools[0].function"),
    ([WEATHER, WEATHER], None, "tools"),
    ([WEATHER], {"type": "function", "function": {"name": "nope"}}, "tool_choice"),
    ([WEATHER], "sometimes", "tool_choice"),
    (None, "required", "tool_choice"),
])
def test_bad_tools_name_the_field(tools: list | None, choice: object, param: str) -> None:
    with pytest.raises(ToolError) as info:
        tool_plan(tools, choice, None)
    assert info.value.param == param


NAMES = ("get_weather", "get_time")


@pytest.mark.parametrize("text", [
    '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>',
    '[TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Oslo"}}]',
    '{"name": "get_weather", "parameters": {"city": "Oslo"}}',
    '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Oslo"}}',
])
def test_known_formats_parse_to_one_call(text: str) -> None:
    content, calls = parse_auto(text, NAMES)
    assert content is None and len(calls) == 1
    fn = calls[0]["function"]
    assert fn["name"] == "get_weather" and json.loads(fn["arguments"]) == {"city": "Oslo"}
    assert calls[0]["id"].startswith("call_") and calls[0]["type"] == "function"


def test_parse_keeps_content_and_several_calls() -> None:
    text = ('Let me check.\n<tool_call>{"name": "get_time", "arguments": {}}</tool_call>\n'
            '<tool_call>{"name": "get_weather", "arguments": {"city": "Rome"}}</tool_call>')
    content, calls = parse_auto(text, NAMES)
    assert content == "Let me check." and [c["function"]["name"] for c in calls] == [
        "get_time", "get_weather"]
    # Unknown tool names and non-JSON stay content.
    for plain in ('{"name": "rm_rf", "parameters": {}}', "Hello {there}", "The weather is fine."):
        assert parse_auto(plain, NAMES) == (plain, [])


def test_message_and_finish_reason() -> None:
    plan = tool_plan([WEATHER], "required", None)
    msg, reason = message_of('[{"name": "get_weather", "parameters": {"city": "Oslo"}}]',
                             "stop", plan)
    assert reason == "tool_calls" and msg["content"] is None
    assert json.loads(msg["tool_calls"][0]["function"]["arguments"]) == {"city": "Oslo"}
    named = tool_plan([WEATHER], {"type": "function", "function": {"name": "get_weather"}}, None)
    msg, reason = message_of('{"city": "Oslo"}', "stop", named)
    assert reason == "tool_calls" and msg["tool_calls"][0]["function"]["arguments"] == \
        '{"city": "Oslo"}'
    assert message_of("hi", "length", None) == ({"role": "assistant", "content": "hi"},
                                                "length")


def test_stream_passes_content_and_holds_calls() -> None:
    plan = tool_plan([WEATHER], None, None)
    assert plan is not None
    plain = ToolCallStream(plan)
    assert plain.feed("  ") is None
    assert plain.feed("Sunny") == {"content": "  Sunny"}
    assert plain.feed(" today") == {"content": " today"}
    assert plain.finish("stop") == ([], "stop")
    call = ToolCallStream(plan)
    for piece in ["<tool", "_call>", '{"name": "get_weather", ', '"arguments": {"city": "Oslo"}}',
                  "</tool_call>"]:
        assert call.feed(piece) is None
    deltas, reason = call.finish("stop")
    assert reason == "tool_calls" and len(deltas) == 1
    delta = deltas[0]["tool_calls"][0]
    assert delta["index"] == 0 and delta["function"]["name"] == "get_weather"
    # Something that looked like a call but is not one goes out as content at the end.
    odd = ToolCallStream(plan)
    assert odd.feed("{not a call}") is None
    assert odd.finish("stop") == ([{"content": "{not a call}"}], "stop")
