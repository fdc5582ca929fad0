"""Structured output asked for over HTTP, in every spelling clients use, to one constraint.

- OpenAI: `response_format` `{"type": "json_object"}` or `{"type": "json_schema",
  "json_schema": {"name": ..., "schema": {...}, "strict": ...}}` (`text`: none). The output is
  constrained whether `strict` is true or not.
- vLLM: `structured_outputs` `{"json" | "regex" | "choice" | "grammar" | "json_object": ...}`.
- vLLM's removed names `guided_json`, `guided_regex`, `guided_choice`, `guided_grammar`: accepted
  and mapped (a server that ignored them would answer unconstrained: the bug users hit).

At most one source and one constraint per request; anything else, or a constraint this server
cannot serve, is a 400 that names the field. Never silently unconstrained.
"""

from __future__ import annotations

from typing import Any

from services.common import errors as e
from services.common.structured import to_pb
from slora.v1 import inference_pb2 as pb
from slora_core.structured.spec import StructuredOutput, StructuredOutputError

GUIDED = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice",
          "guided_grammar": "grammar"}
# Request fields this module reads (the request models declare them; none is "ignored").
FIELDS = ("response_format", "structured_outputs", *GUIDED, "guided_decoding_backend")
# structured_outputs keys that pick a constraint; the others vLLM has change how it is
# compiled, and are refused rather than ignored.
_SO_KINDS = ("json", "regex", "choice", "grammar", "json_object")
_SO_NEUTRAL = {"disable_fallback": None, "disable_any_whitespace": None,
               "disable_additional_properties": None, "whitespace_pattern": None}


class ConstraintError(e.InvalidArgument):
    """A structured-output field that cannot be served; `param` names it."""

    def __init__(self, param: str, message: str) -> None:
        super().__init__(f"{param}: {message}")
        self.param = param


def _spec(param: str, kind: str, value: Any) -> StructuredOutput:
    try:
        if kind == "json":
            if isinstance(value, str | dict | bool):
                return StructuredOutput.json_schema(value)
            raise StructuredOutputError("a JSON schema must be an object (or its JSON text)")
        if kind == "json_object":
            if value is not True:
                raise StructuredOutputError("json_object must be true when given")
            return StructuredOutput("json_object")
        if kind == "choice":
            return StructuredOutput.choice(value)
        if not isinstance(value, str):
            raise StructuredOutputError(f"{kind} must be a string")
        return StructuredOutput(kind, value)
    except StructuredOutputError as exc:
        raise ConstraintError(param, str(exc)) from None


def _response_format(rf: Any) -> StructuredOutput | None:
    if not isinstance(rf, dict):
        raise ConstraintError("response_format", "must be an object with a type")
    kind = rf.get("type")
    if kind in (None, "text"):
        return None
    if kind == "json_object":
        return StructuredOutput("json_object")
    if kind == "json_schema":
        body = rf.get("json_schema")
        if not isinstance(body, dict) or "schema" not in body:
            raise ConstraintError("response_format.json_schema",
                                  "json_schema needs a schema: {name, schema, strict}")
        return _spec("response_format.json_schema.schema", "json", body["schema"])
    raise ConstraintError("response_format.type",
                          f"{kind!r} is not supported (text, json_object, json_schema)")


def _structured_outputs(so: Any) -> StructuredOutput | None:
    if not isinstance(so, dict):
        raise ConstraintError("structured_outputs", "must be an object")
    given = {k: v for k, v in so.items() if v is not None and v is not False}
    unknown = sorted(k for k in given if k not in _SO_KINDS and k not in _SO_NEUTRAL)
    if unknown:
        raise ConstraintError("structured_outputs", f"{', '.join(unknown)} not supported "
                              f"(one of {', '.join(_SO_KINDS)})")
    kinds = [k for k in _SO_KINDS if k in given]
    if len(kinds) > 1:
        raise ConstraintError("structured_outputs", f"give one constraint, got {kinds}")
    if not kinds:
        return None
    return _spec(f"structured_outputs.{kinds[0]}", kinds[0], given[kinds[0]])


def constraint_of(fields: dict[str, Any]) -> StructuredOutput | None:
    """The one constraint the request asks for (None: unconstrained), from its `FIELDS`
    (absent or None: not given). Raises ConstraintError naming the field."""
    found: list[tuple[str, StructuredOutput]] = []
    if fields.get("response_format") is not None:
        spec = _response_format(fields["response_format"])
        if spec is not None:
            found.append(("response_format", spec))
    if fields.get("structured_outputs") is not None:
        spec = _structured_outputs(fields["structured_outputs"])
        if spec is not None:
            found.append(("structured_outputs", spec))
    for name, kind in GUIDED.items():
        if fields.get(name) is not None:
            found.append((name, _spec(name, kind, fields[name])))
    if len(found) > 1:
        names = ", ".join(name for name, _ in found)
        raise ConstraintError(found[1][0], f"give one structured output, got {names}")
    return found[0][1] if found else None


def fields_of(req: Any) -> dict[str, Any]:
    """`FIELDS` of a parsed request, declared or carried as extra fields."""
    extra = getattr(req, "model_extra", None) or {}
    return {name: getattr(req, name, extra.get(name)) for name in FIELDS}


def apply_constraint(req: Any, calls: list[pb.GenerateRequest]) -> StructuredOutput | None:
    """Set the request's constraint (if any) on every call of its plan; returns it."""
    spec = constraint_of(fields_of(req))
    if spec is not None:
        msg = to_pb(spec)
        for call in calls:
            call.structured_output.CopyFrom(msg)
    return spec
