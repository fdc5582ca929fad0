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
