"""`StructuredOutput` <-> its protobuf message, at the service edge (gateway and worker)."""

from __future__ import annotations

import json
from typing import Any

from services.common import errors as e
from slora.v1 import inference_pb2 as pb
from slora_core.structured.spec import StructuredOutput, StructuredOutputError


def to_pb(spec: StructuredOutput) -> pb.StructuredOutput:
    if spec.kind == "json_object":
        return pb.StructuredOutput(json_object=True)
    if spec.kind == "choice":
        return pb.StructuredOutput(choice=pb.ChoiceList(choices=spec.choices()))
    msg = pb.StructuredOutput()
    setattr(msg, spec.kind, spec.value)  # json_schema, regex or grammar: a string field
    return msg


def from_pb(msg: pb.StructuredOutput) -> StructuredOutput | None:
    """The request's constraint (None when no constraint is set). Raises InvalidArgument naming
    the problem (malformed, past the size limit)."""
    which = msg.WhichOneof("constraint")
    try:
        if which is None:
            return None
        if which == "json_object":
            if not msg.json_object:
                raise StructuredOutputError("structured_output.json_object must be true when set")
            return StructuredOutput("json_object")
        if which == "choice":
            return StructuredOutput.choice(list(msg.choice.choices))
        if which == "json_schema":
            return StructuredOutput.json_schema(msg.json_schema)
        return StructuredOutput(which, getattr(msg, which))
    except StructuredOutputError as exc:
        raise e.InvalidArgument(f"structured_output: {exc}") from None


def to_wire(spec: StructuredOutput | None) -> tuple[str, str] | None:
    """The constraint as the engine-core protocol carries it (front -> core)."""
    return None if spec is None else (spec.kind, spec.value)


def from_wire(value: tuple[str, str] | list[str] | None) -> StructuredOutput | None:
    """The engine core's side of `to_wire` (msgpack gives the tuple back as a list)."""
    return None if value is None else StructuredOutput(value[0], value[1])


def template_tools(tools_json: str) -> list[Any]:
    """A request's tools for the chat template (`tools_json` as the gateway wrote it)."""
    try:
        tools = json.loads(tools_json)
    except json.JSONDecodeError as exc:
        raise e.InvalidArgument(f"tools_json is not valid JSON: {exc}") from None
    if not isinstance(tools, list):
        raise e.InvalidArgument("tools_json must be a JSON array of tools")
    return tools


def template_tool_calls(tool_calls_json: str) -> list[Any]:
    """An assistant turn's tool calls for the chat template: OpenAI's shape, with each
    call's `arguments` parsed into an object, as templates (Qwen, Hermes, Llama 3) expect."""
    calls = template_tools(tool_calls_json)
    out = []
    for call in calls:
        fn = call.get("function") if isinstance(call, dict) else None
        if isinstance(fn, dict) and isinstance(fn.get("arguments"), str):
            try:
                args = json.loads(fn["arguments"])
            except json.JSONDecodeError:
                args = fn["arguments"]
            call = {**call, "function": {**fn, "arguments": args}}
        out.append(call)
    return out
