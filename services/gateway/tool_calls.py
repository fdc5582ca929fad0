"""Chat tools: the request's `tools` and `tool_choice` checked and planned, and the model's
output parsed into OpenAI `tool_calls` (whole, or as stream deltas).

- `tool_choice` `none`: tools are not given to the template, output is plain content.
- `auto` (the default with tools): tools go to the chat template; the output is parsed for
  calls in the JSON formats of common templates (Hermes/Qwen `<tool_call>{...}</tool_call>`,
  Mistral `[TOOL_CALLS] [...]`, Llama 3 `{"name": ..., "parameters": {...}}` with an optional
  `<|python_tag|>`); text that holds no call of a known tool stays content.
- `required`: the output is constrained to a JSON array of `{"name", "parameters"}` calls of
  the given tools (vLLM's shape), at most MAX_PARALLEL_CALLS (1 without parallel_tool_calls).
- a named function: the output is constrained to that function's parameters schema and is its
  one call's arguments.
A response with calls has `finish_reason` "tool_calls".
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, field
from typing import Any, Literal

from services.common import errors as e
from services.common.structured import to_pb
from services.gateway.constraints import constraint_of, fields_of
from slora.v1 import inference_pb2 as pb
from slora_core.structured.spec import StructuredOutput, StructuredOutputError

MAX_TOOLS = 128
MAX_PARALLEL_CALLS = 4
Mode = Literal["auto", "required", "named"]
_HERMES = re.compile(r"<tool_call>\s*(.*?)\s*(?:</tool_call>|$)", re.S)
_MISTRAL = "[TOOL_CALLS]"
_PYTHON_TAG = "<|python_tag|>"
# Output that starts with one of these may be a call: a stream holds it back until it knows.
_MARKERS = ("<tool_call>", _MISTRAL, _PYTHON_TAG, "{", "[")


class ToolError(e.InvalidArgument):
    def __init__(self, param: str, message: str) -> None:
        super().__init__(f"{param}: {message}")
        self.param = param


@dataclass(frozen=True)
class ToolPlan:
    """What the request's tools mean for generation and for the response."""

    tools: list[dict[str, Any]]       # OpenAI's tools, for the chat template
    mode: Mode
    names: tuple[str, ...]
    named: str | None = None
    constraint: StructuredOutput | None = None

    @property
    def tools_json(self) -> str:
        return json.dumps(self.tools)


def _function(i: int, tool: Any) -> dict[str, Any]:
    if not isinstance(tool, dict) or tool.get("type", "function") != "function":
        raise ToolError(f"tools[{i}]", "only {\"type\": \"function\"} tools are supported")
    fn = tool.get("function")
    if not isinstance(fn, dict) or not isinstance(fn.get("name"), str) or not fn["name"]:
        raise ToolError(f"tools[{i}].function", "needs a name")
    params = fn.get("parameters", {"type": "object", "properties": {}})
    if not isinstance(params, dict):
        raise ToolError(f"tools[{i}].function.parameters", "must be a JSON schema object")
    return {**fn, "parameters": params}


def tool_plan(tools: Any, tool_choice: Any, parallel_tool_calls: bool | None
              ) -> ToolPlan | None:
    """The plan for a chat request's tools (None: no tools in play). Raises ToolError."""
    if not tools:
        if tool_choice not in (None, "none", "auto"):
            raise ToolError("tool_choice", "needs tools")
        return None
    if not isinstance(tools, list) or len(tools) > MAX_TOOLS:
        raise ToolError("tools", f"must be a list of at most {MAX_TOOLS} tools")
    fns = [_function(i, t) for i, t in enumerate(tools)]
    names = tuple(f["name"] for f in fns)
    if len(set(names)) != len(names):
        raise ToolError("tools", "function names must be unique")
    normalised = [{"type": "function", "function": f} for f in fns]
    if tool_choice in (None, "auto"):
        return ToolPlan(normalised, "auto", names)
    if tool_choice == "none":
        return None
    if tool_choice == "required":
        cap = 1 if parallel_tool_calls is False else MAX_PARALLEL_CALLS
        return ToolPlan(normalised, "required", names,
                        constraint=_constraint("tool_choice", _calls_schema(fns, cap)))
    name = _named_choice(tool_choice)
    if name not in names:
        raise ToolError("tool_choice", f"names {name!r}, which is not among the tools")
    params = fns[names.index(name)]["parameters"]
    return ToolPlan(normalised, "named", names, named=name,
                    constraint=_constraint(f"tools[{names.index(name)}].function.parameters",
                                           params))


def _named_choice(choice: Any) -> str:
    if isinstance(choice, dict) and choice.get("type") == "function":
        fn = choice.get("function")
        if isinstance(fn, dict) and isinstance(fn.get("name"), str):
            return str(fn["name"])
    raise ToolError("tool_choice", "must be none, auto, required or "
                    "{\"type\": \"function\", \"function\": {\"name\": ...}}")


def _calls_schema(fns: list[dict[str, Any]], cap: int) -> dict[str, Any]:
    call = [{"type": "object", "properties": {"name": {"enum": [f["name"]]},
                                              "parameters": f["parameters"]},
             "required": ["name", "parameters"]} for f in fns]
    return {"type": "array", "minItems": 1, "maxItems": cap,
            "items": call[0] if len(call) == 1 else {"anyOf": call}}


def _constraint(param: str, schema: dict[str, Any]) -> StructuredOutput:
    try:
        return StructuredOutput.json_schema(schema)
    except StructuredOutputError as exc:
        raise ToolError(param, str(exc)) from None


# ---- parsing the output -------------------------------------------------------------------
def _call(name: str, arguments: Any) -> dict[str, Any]:
    args = arguments if isinstance(arguments, str) else json.dumps(arguments)
    return {"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
            "function": {"name": name, "arguments": args}}


def _as_calls(items: Any, names: tuple[str, ...]) -> list[dict[str, Any]] | None:
    """`{"name", "arguments" | "parameters"}` objects (one or a list) as calls; None unless
    every one names a known tool."""
    items = items if isinstance(items, list) else [items]
    calls = []
    for item in items:
        if not isinstance(item, dict) or item.get("name") not in names:
            return None
        args = item.get("arguments", item.get("parameters", {}))
        if isinstance(args, str):
            try:
                json.loads(args)
            except json.JSONDecodeError:
                return None
        elif not isinstance(args, dict):
            return None
        calls.append(_call(item["name"], args))
    return calls or None


def _loads(text: str) -> Any:
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return None


def parse_auto(text: str, names: tuple[str, ...]) -> tuple[str | None, list[dict[str, Any]]]:
    """(content, calls) of a model's free output: calls in one of the known formats, the text
    before them as content; no calls when nothing parses as a call of a known tool."""
    stripped = text.strip()
    if "<tool_call>" in stripped:
        found = [_loads(m) for m in _HERMES.findall(stripped)]
        calls = _as_calls(found, names) if found and None not in found else None
        if calls:
            content = stripped[:stripped.index("<tool_call>")].strip()
            return content or None, calls
    if stripped.startswith(_MISTRAL):
        calls = _as_calls(_loads(stripped[len(_MISTRAL):].strip()), names)
        if calls:
            return None, calls
    body = stripped.removeprefix(_PYTHON_TAG).strip()
    if body.startswith(("{", "[")):
        parsed = _loads(body)
        if parsed is None and ";" in body:  # Llama 3.2: calls separated by semicolons
            parts = [_loads(p) for p in body.split(";")]
            parsed = None if None in parts else parts
        calls = _as_calls(parsed, names) if parsed is not None else None
        if calls:
            return None, calls
    return text, []


def parse_output(text: str, plan: ToolPlan) -> tuple[str | None, list[dict[str, Any]]]:
    """(content, tool calls) of a finished choice under `plan`."""
    if plan.mode == "named":
        assert plan.named is not None
        return None, [_call(plan.named, text.strip())]
    if plan.mode == "required":
        calls = _as_calls(_loads(text), plan.names)
        return (None, calls) if calls else (text, [])
    return parse_auto(text, plan.names)


def message_of(text: str, finish_reason: str, plan: ToolPlan | None
               ) -> tuple[dict[str, Any], str]:
    """A non-streamed chat choice's message and finish reason ("tool_calls" when it called)."""
    if plan is None:
        return {"role": "assistant", "content": text}, finish_reason
    content, calls = parse_output(text, plan)
    if not calls:
        return {"role": "assistant", "content": content}, finish_reason
    return ({"role": "assistant", "content": content, "tool_calls": calls},
            "tool_calls" if finish_reason == "stop" else finish_reason)


@dataclass
class ToolCallStream:
    """A streamed chat choice under a tool plan: content deltas pass through as they come
    until the output may be a call (it starts like one, or the choice is constrained to
    calls); from there text is held, and at the end it goes out as tool-call deltas (or, if it
    held no call, as one content delta)."""

    plan: ToolPlan
    _held: list[str] = field(default_factory=list)
    _passing: bool = False

    def feed(self, text: str) -> dict[str, Any] | None:
        """The delta to send for this text now (None: held)."""
        if self._passing:
            return {"content": text}
        self._held.append(text)
        if self.plan.mode != "auto":
            return None
        so_far = "".join(self._held).lstrip()
        if not so_far or any(m.startswith(so_far) or so_far.startswith(m) for m in _MARKERS):
            return None
        self._passing = True
        held, self._held = "".join(self._held), []
        return {"content": held}

    def finish(self, finish_reason: str) -> tuple[list[dict[str, Any]], str]:
        """The deltas the held text becomes, and the finish reason to send."""
        held, self._held = "".join(self._held), []
        if self._passing or not held:
            return [], finish_reason
        content, calls = parse_output(held, self.plan)
        if not calls:
            return [{"content": held}], finish_reason
        deltas: list[dict[str, Any]] = [{"content": content}] if content else []
        deltas += [{"tool_calls": [{"index": i, **call}]} for i, call in enumerate(calls)]
        return deltas, "tool_calls" if finish_reason == "stop" else finish_reason


def plan_chat(req: Any, chat: pb.GenerateRequest) -> ToolPlan | None:
    """Tools and structured output of a chat request, set on its (one) GenerateRequest: the
    tools for the template, the tool turns of the history, the constraint (a response_format
    and a required or named tool choice are exclusive). Raises ToolError/ConstraintError."""
    plan = tool_plan(req.tools, req.tool_choice, req.parallel_tool_calls)
    spec = constraint_of(fields_of(req))
    if plan is not None and plan.constraint is not None:
        if spec is not None:
            raise ToolError("tool_choice", f"a {plan.mode} tool choice constrains the output; "
                            "it cannot be combined with response_format or structured_outputs")
        spec = plan.constraint
    if spec is not None:
        chat.structured_output.CopyFrom(to_pb(spec))
    if plan is not None:
        chat.tools_json = plan.tools_json
    for i, (m, msg) in enumerate(zip(req.messages, chat.messages, strict=True)):
        extra = m.model_extra or {}
        if extra.get("tool_calls"):
            if not isinstance(extra["tool_calls"], list):
                raise ToolError(f"messages[{i}].tool_calls", "must be a list")
            msg.tool_calls_json = json.dumps(extra["tool_calls"])
        if extra.get("tool_call_id") is not None:
            msg.tool_call_id = str(extra["tool_call_id"])
    return plan


def stream_deltas(stream: ToolCallStream, text: str | None, finish_reason: str | None
                  ) -> list[tuple[dict[str, Any], str | None]]:
    """The (delta, finish_reason) events a streamed chat choice under tools sends for one
    message of its call: a chunk's `text`, or the end with `finish_reason`."""
    if finish_reason is None:
        delta = stream.feed(text or "")
        return [] if delta is None else [(delta, None)]
    deltas, reason = stream.finish(finish_reason)
    return [(d, None) for d in deltas] + [({}, reason)]
