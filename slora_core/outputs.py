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


# The start of `RequestOutput.error` for a request ended because its logits were NaN or inf
# (finish_reason "error"): the worker counts these as non-finite outputs in canary evidence.
NONFINITE_LOGITS = "non-finite logits"


def nonfinite_logits_error(position: int) -> str:
    """The error message of a request whose logits for output token `position` (0-based) were
    not finite."""
    return (f"{NONFINITE_LOGITS} (NaN or inf) for output token {position}: the model's "
            "numerics failed on this request, so no token was produced")


def is_nonfinite_failure(out: RequestOutput) -> bool:
    """The output ends a request that failed on non-finite logits."""
    return out.finish_reason == "error" and (out.error or "").startswith(NONFINITE_LOGITS)


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
