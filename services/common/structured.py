"""`StructuredOutput` <-> its protobuf message, at the service edge (gateway and worker)."""

from __future__ import annotations

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
