"""What the engine reports back per request and step."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class TokenLogprob:
    token_id: int
    logprob: float
    top_logprobs: tuple[tuple[int, float], ...] = ()


@dataclass
class RequestOutput:
    """The new part of one request's output since the previous step (a streaming delta)."""

    request_id: str
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    logprobs: list[TokenLogprob] = field(default_factory=list)
    finished: bool = False
    finish_reason: str | None = None  # "stop", "length", "abort", "error"
    error: str | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0


def merge_outputs(first: RequestOutput, later: RequestOutput) -> RequestOutput:
    """One delta covering two consecutive deltas of the same request (streams that fall behind
    send fewer, larger chunks); the later one's status and counts win."""
    if first.request_id != later.request_id:
        raise ValueError(f"cannot merge outputs of {first.request_id!r} and {later.request_id!r}")
    return RequestOutput(
        request_id=later.request_id, token_ids=first.token_ids + later.token_ids,
        text=first.text + later.text, logprobs=first.logprobs + later.logprobs,
        finished=later.finished, finish_reason=later.finish_reason, error=later.error,
        prompt_tokens=later.prompt_tokens, completion_tokens=later.completion_tokens,
    )
