"""What a constrained request asks for: one grammar in one of five forms, validated on arrival.

Plain Python (no grammar backend imported): the worker front checks a request with it before
the engine sees it, and the engine core rebuilds it from the wire.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from typing import Any

# The forms a constraint takes. `json_object`: any JSON object (OpenAI's json mode);
# `json_schema`: a JSON Schema document; `regex`; `choice`: one of a list of strings;
# `grammar`: EBNF (xgrammar's GBNF dialect, or Lark for the llguidance fallback).
KINDS = ("json_object", "json_schema", "regex", "choice", "grammar")
# The largest constraint text accepted. A schema or grammar past it is refused before anything
# is compiled: compile time and matcher memory grow with it.
MAX_SPEC_BYTES = 64 * 1024
MAX_CHOICES = 1024


class StructuredOutputError(ValueError):
    """A constraint that can never be served: malformed, too large, or refused by the grammar
    compiler (its message names the problem)."""


@dataclass(frozen=True)
class StructuredOutput:
    """One request's output constraint. `value` is the schema (JSON text), the regex, the
    choices (a JSON array of strings) or the grammar text; empty for `json_object`.

    Raises StructuredOutputError naming the problem when the kind is unknown, the text passes
    MAX_SPEC_BYTES, a schema is not a JSON object (or boolean), or choices are not a non-empty
    list of strings."""

    kind: str
    value: str = ""

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise StructuredOutputError(f"unknown structured output kind {self.kind!r}; "
                                        f"expected one of {', '.join(KINDS)}")
        if not isinstance(self.value, str):
            raise StructuredOutputError(f"{self.kind}: the constraint must be text, got "
                                        f"{type(self.value).__name__}")
        size = len(self.value.encode())
        if size > MAX_SPEC_BYTES:
            raise StructuredOutputError(f"{self.kind} is {size} bytes, past the limit of "
                                        f"{MAX_SPEC_BYTES} bytes")
        _CHECKS[self.kind](self.value)

    @property
    def digest(self) -> str:
        """sha256 of (kind, value): the grammar cache's key with the tokenizer's identity."""
        return hashlib.sha256(f"{self.kind}\0{self.value}".encode()).hexdigest()

    @classmethod
    def json_schema(cls, schema: Any) -> StructuredOutput:
        """From a schema given as a dict, a bool or JSON text (re-serialised compactly;
        property order kept: it is the order of the output)."""
        if isinstance(schema, str):
            schema = _parse_json("json_schema", schema)
        try:
            text = json.dumps(schema, separators=(",", ":"))
        except (TypeError, ValueError) as e:
            raise StructuredOutputError(f"json_schema is not JSON-serialisable: {e}") from None
        return cls("json_schema", text)

    @classmethod
    def choice(cls, choices: Any) -> StructuredOutput:
        if not isinstance(choices, list | tuple):
            raise StructuredOutputError("choice must be a list of strings")
        return cls("choice", json.dumps(list(choices)))

    def schema(self) -> Any:
        """The parsed JSON schema (`json_schema` only)."""
        return json.loads(self.value)

    def choices(self) -> list[str]:
        """The parsed choice list (`choice` only)."""
        return list(json.loads(self.value))


def _parse_json(kind: str, text: str) -> Any:
    try:
        return json.loads(text)
    except json.JSONDecodeError as e:
        raise StructuredOutputError(f"{kind} is not valid JSON: {e}") from None


def _check_schema(text: str) -> None:
    schema = _parse_json("json_schema", text)
    if not isinstance(schema, dict | bool):
        raise StructuredOutputError(f"json_schema must be a JSON object, got "
                                    f"{type(schema).__name__}")


def _check_choice(text: str) -> None:
    choices = _parse_json("choice", text)
    if (not isinstance(choices, list) or not choices
            or not all(isinstance(c, str) for c in choices)):
        raise StructuredOutputError("choice must be a non-empty list of strings")
    if len(choices) > MAX_CHOICES:
        raise StructuredOutputError(f"choice has {len(choices)} entries, past the limit of "
                                    f"{MAX_CHOICES}")


def _check_text(kind: str) -> Any:
    def check(text: str) -> None:
        if not text:
            raise StructuredOutputError(f"{kind} must not be empty")
    return check


def _check_none(text: str) -> None:
    if text:
        raise StructuredOutputError("json_object takes no value")


_CHECKS = {"json_object": _check_none, "json_schema": _check_schema, "choice": _check_choice,
           "regex": _check_text("regex"), "grammar": _check_text("grammar")}
