"""Per-request sampling parameters, validated once when a request arrives."""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

MAX_TOP_LOGPROBS = 20
MAX_LOGIT_BIAS = 100.0  # OpenAI's range for a logit_bias value: [-100, 100]
MAX_PENALTY = 2.0       # OpenAI's range for presence and frequency penalties: [-2, 2]
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


def _bias_pairs(value: Any) -> tuple[tuple[int, float], ...]:
    """logit_bias as sorted (token id, bias) pairs, from a mapping or pairs."""
    items = value.items() if isinstance(value, Mapping) else _as_tuple("logit_bias", value)
    pairs = []
    for item in items:
        if not isinstance(item, tuple | list) or len(item) != 2:
            raise ValueError(f"logit_bias must map token ids to biases, got {item!r}")
        pairs.append((item[0], item[1]))
    return tuple(sorted(pairs, key=lambda kv: kv[0] if isinstance(kv[0], int) else -1))


@dataclass(frozen=True)
class SamplingParams:
    """How one request turns logits into tokens and when it stops.

    Semantics follow vLLM (and Hugging Face `generate` where they agree): `logit_bias` is added
    to the logits; `min_new_tokens` masks EOS and `stop_token_ids` until that many tokens were
    generated; the repetition penalty divides positive (multiplies negative) logits of every
    token seen in prompt + output; `frequency_penalty` x (times a token was generated) and
    `presence_penalty` x (generated at all) are subtracted (OpenAI's definition, generated tokens
    only); then temperature, min-p (drop tokens less likely than `min_p` times the most likely),
    top-k, top-p. `temperature == 0` is greedy. The same `seed` yields the same tokens whatever
    the batch. `prompt_logprobs` (None: off) asks for the prompt tokens' logprobs with that many
    alternatives. `include_stop_str_in_output` and `skip_special_tokens` shape the text only.
    Every field is validated in `__post_init__`; a bad value raises ValueError naming the field
    and the allowed range. Lists given for `stop` / `stop_token_ids` are stored as tuples, a
    mapping given for `logit_bias` as sorted (token id, bias) pairs.
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
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: tuple[tuple[int, float], ...] = ()
    prompt_logprobs: int | None = None
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True

    def __post_init__(self) -> None:
        # frozen: normalise through object.__setattr__ before anything reads the fields.
        object.__setattr__(self, "stop", _as_tuple("stop", self.stop))
        object.__setattr__(self, "stop_token_ids", _as_tuple("stop_token_ids", self.stop_token_ids))
        object.__setattr__(self, "logit_bias", _bias_pairs(self.logit_bias))
        self._validate_floats()
        self._validate_ints()
        self._validate_stops()
        self._validate_extras()
        for name in ("ignore_eos", "include_stop_str_in_output", "skip_special_tokens"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be a bool, got {getattr(self, name)!r}")

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

    def _validate_extras(self) -> None:
        """vLLM's extras: min_p, OpenAI's penalties, logit_bias, prompt_logprobs."""
        min_p = _check_float("min_p", self.min_p)
        if not 0 <= min_p <= 1:
            raise ValueError(f"min_p must be in [0, 1], got {min_p}")
        object.__setattr__(self, "min_p", min_p)
        for name in ("presence_penalty", "frequency_penalty"):
            value = _check_float(name, getattr(self, name))
            if not -MAX_PENALTY <= value <= MAX_PENALTY:
                raise ValueError(f"{name} must be in [-{MAX_PENALTY}, {MAX_PENALTY}], got {value}")
            object.__setattr__(self, name, value)
        pairs = []
        for token, bias in self.logit_bias:
            _check_int("logit_bias token id", token, 0)
            value = _check_float("logit_bias value", bias)
            if not -MAX_LOGIT_BIAS <= value <= MAX_LOGIT_BIAS:
                raise ValueError(f"logit_bias values must be in [-{MAX_LOGIT_BIAS}, "
                                 f"{MAX_LOGIT_BIAS}], got {bias} for token {token}")
            pairs.append((token, value))
        object.__setattr__(self, "logit_bias", tuple(pairs))
        if self.prompt_logprobs is not None:
            _check_int("prompt_logprobs", self.prompt_logprobs, 0, MAX_TOP_LOGPROBS)

    @property
    def needs_history(self) -> bool:
        """The sampler reads this request's token history (a penalty is set)."""
        return (self.repetition_penalty != 1.0 or self.presence_penalty != 0.0
                or self.frequency_penalty != 0.0)

    @property
    def is_greedy(self) -> bool:
        """True when the request takes the argmax and draws no random numbers."""
        return self.temperature == 0.0
