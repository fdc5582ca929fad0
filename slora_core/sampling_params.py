"""Per-request sampling parameters, validated once when a request arrives."""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

MAX_TOP_LOGPROBS = 20
# torch.Generator.manual_seed accepts any value of a uint64; keep seeds non-negative so the same
# seed means the same generator state on every device.
MAX_SEED = 2**64 - 1


def _check_int(name: str, value: Any, low: int, high: int | None = None) -> None:
    # bool is an int subclass; `top_k=True` is a caller bug, not a 1.
    if not isinstance(value, int) or isinstance(value, bool):
        raise ValueError(f"{name} must be an integer, got {value!r}")
    if value < low or (high is not None and value > high):
        upper = "" if high is None else f" and <= {high}"
        raise ValueError(f"{name} must be >= {low}{upper}, got {value}")


def _check_float(name: str, value: Any) -> float:
    if not isinstance(value, int | float) or isinstance(value, bool) or not math.isfinite(value):
        raise ValueError(f"{name} must be a finite number, got {value!r}")
    return float(value)


def _as_tuple(name: str, value: Any) -> tuple[Any, ...]:
    if isinstance(value, str | bytes):
        # A bare string would otherwise become a tuple of one-character stop strings.
        raise ValueError(f"{name} must be a sequence, not a single {type(value).__name__}")
    if not isinstance(value, Iterable):
        raise ValueError(f"{name} must be a sequence, got {value!r}")
    return tuple(value)


@dataclass(frozen=True)
class SamplingParams:
    """How one request turns logits into tokens and when it stops.

    Semantics follow Hugging Face `generate`: the repetition penalty divides positive (multiplies
    negative) logits of every token seen in prompt + output; `min_new_tokens` masks EOS and
    `stop_token_ids` until that many tokens were generated; then temperature, top-k, top-p.
    `temperature == 0` is greedy. The same `seed` yields the same tokens whatever the batch.
    Every field is validated in `__post_init__`; a bad value raises ValueError naming the field
    and the allowed range. Lists given for `stop` / `stop_token_ids` are stored as tuples.
    """

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    repetition_penalty: float = 1.0
    seed: int | None = None
    max_new_tokens: int = 64
    min_new_tokens: int = 0
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    top_logprobs: int = 0

    def __post_init__(self) -> None:
        # frozen: normalise through object.__setattr__ before anything reads the fields.
        object.__setattr__(self, "stop", _as_tuple("stop", self.stop))
        object.__setattr__(self, "stop_token_ids", _as_tuple("stop_token_ids", self.stop_token_ids))
        self._validate_floats()
        self._validate_ints()
        self._validate_stops()
        if not isinstance(self.ignore_eos, bool):
            raise ValueError(f"ignore_eos must be a bool, got {self.ignore_eos!r}")

    def _validate_floats(self) -> None:
        temperature = _check_float("temperature", self.temperature)
        if temperature < 0:
            raise ValueError(f"temperature must be >= 0 (0 = greedy), got {temperature}")
        top_p = _check_float("top_p", self.top_p)
        if not 0 < top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {top_p}")
        penalty = _check_float("repetition_penalty", self.repetition_penalty)
        if penalty <= 0:
            raise ValueError(f"repetition_penalty must be > 0, got {penalty}")
        object.__setattr__(self, "temperature", temperature)
        object.__setattr__(self, "top_p", top_p)
        object.__setattr__(self, "repetition_penalty", penalty)

    def _validate_ints(self) -> None:
        _check_int("top_k", self.top_k, 0)
        if self.seed is not None:
            _check_int("seed", self.seed, 0, MAX_SEED)
        _check_int("max_new_tokens", self.max_new_tokens, 1)
        _check_int("min_new_tokens", self.min_new_tokens, 0, self.max_new_tokens)
        _check_int("top_logprobs", self.top_logprobs, 0, MAX_TOP_LOGPROBS)

    def _validate_stops(self) -> None:
        for s in self.stop:
            if not isinstance(s, str) or not s:
                raise ValueError(f"stop must hold non-empty strings, got {s!r}")
        for t in self.stop_token_ids:
            _check_int("stop_token_ids[i]", t, 0)

    @property
    def is_greedy(self) -> bool:
        """True when the request takes the argmax and draws no random numbers."""
        return self.temperature == 0.0
