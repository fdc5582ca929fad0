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
    error_kind: str = ""  # with `error`: ADAPTER_UNLOADABLE, DEADLINE or NONFINITE
    prompt_tokens: int = 0
    completion_tokens: int = 0
    # Prompt tokens whose KV came from the prefix cache instead of being computed (OpenAI's
    # usage.prompt_tokens_details.cached_tokens), as found when the request was first scheduled.
    cached_tokens: int = 0


# Why a request ended with an error (`RequestOutput.error_kind`); servers map each to a status
# code and the worker counts NONFINITE as a non-finite output in canary evidence.
ADAPTER_UNLOADABLE = "adapter_unloadable"  # its adapter could not be loaded (finish "error")
DEADLINE = "deadline"                      # never scheduled within its deadline ("abort")
NONFINITE = "nonfinite"                    # its logits were NaN or inf ("error")
# The start of a NONFINITE request's error message.
NONFINITE_LOGITS = "non-finite logits"


def nonfinite_logits_error(position: int) -> str:
    """The error message of a request whose logits for output token `position` (0-based) were
    not finite."""
    return (f"{NONFINITE_LOGITS} (NaN or inf) for output token {position}: the model's "
            "numerics failed on this request, so no token was produced")


def is_nonfinite_failure(out: RequestOutput) -> bool:
    """The output ends a request that failed on non-finite logits."""
    return out.finish_reason == "error" and out.error_kind == NONFINITE
