"""Which Generate requests a gateway may resume on another worker when theirs fails
mid-stream (docs/failover.md); the worker's side is services/worker/resume.py."""

from __future__ import annotations

from slora.v1 import inference_pb2 as pb


def not_resumable(request: pb.GenerateRequest) -> str:
    """Why a stream of this request cannot be resumed exactly ('' when it can): the engine
    would have to know which context tokens were generated (output penalties) or replay a
    grammar's state (structured output)."""
    s = request.sampling
    if request.HasField("structured_output"):
        return "structured output"
    if s.presence_penalty or s.frequency_penalty:
        return "presence or frequency penalties"
    return ""


def resumed_request(request: pb.GenerateRequest, emitted: list[int]) -> pb.GenerateRequest:
    """`request` continued after the `emitted` tokens its client already has; what only the
    first chunk carries (prompt logprobs, prompt text) is not asked again."""
    resumed = pb.GenerateRequest()
    resumed.CopyFrom(request)
    resumed.resume_token_ids[:] = emitted
    resumed.sampling.ClearField("prompt_logprobs")
    resumed.return_prompt_text = False
    return resumed
