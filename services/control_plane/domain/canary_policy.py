"""An adapter's canary policy as a validated, immutable value (DESIGN section 4).

The analyzer compares the running canary with the stable version over windows of `window_s`
seconds. Thresholds left at None turn their check off; at least one check must be on, or the
analyzer would promote blind. `steps` are the traffic ratios a canary climbs, one passing window
each, before it is promoted; without steps the analyzer only ever rolls back.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import Any

from services.common.errors import InvalidArgument

MAX_WINDOW_S = 7 * 24 * 3600.0
# Ratios closer than this are the same step (floating-point noise from clients).
STEP_EPSILON = 1e-9


@dataclass(frozen=True)
class CanaryPolicy:
    window_s: float
    min_requests: int
    max_error_rate_increase: float | None = None
    max_ttft_ratio: float | None = None
    max_tpot_ratio: float | None = None
    max_feedback_drop: float | None = None
    min_feedback: int = 1
    steps: tuple[float, ...] = field(default=())

    def __post_init__(self) -> None:
        if not (math.isfinite(self.window_s) and 0.0 < self.window_s <= MAX_WINDOW_S):
            raise InvalidArgument(f"window_seconds must lie in (0, {MAX_WINDOW_S:g}], "
                                  f"got {self.window_s}")
        if self.min_requests < 1:
            raise InvalidArgument(f"min_requests must be >= 1, got {self.min_requests}")
        if self.min_feedback < 1:
            raise InvalidArgument(f"min_feedback must be >= 1, got {self.min_feedback}")
        _check_range("max_error_rate_increase", self.max_error_rate_increase, 0.0, 1.0)
        _check_range("max_ttft_ratio", self.max_ttft_ratio, 1.0, math.inf)
        _check_range("max_tpot_ratio", self.max_tpot_ratio, 1.0, math.inf)
        _check_range("max_feedback_drop", self.max_feedback_drop, 0.0, 2.0)
        if not self.has_checks:
            raise InvalidArgument("a canary policy needs at least one threshold")
        for step in self.steps:
            if not (math.isfinite(step) and 0.0 < step < 1.0):
                raise InvalidArgument(f"steps are traffic ratios in (0, 1), got {step}: "
                                      "promotion follows the last step")
        if any(b <= a for a, b in zip(self.steps, self.steps[1:])):
            raise InvalidArgument(f"steps must rise strictly, got {list(self.steps)}")

    @property
    def has_checks(self) -> bool:
        return any(t is not None for t in (self.max_error_rate_increase, self.max_ttft_ratio,
                                           self.max_tpot_ratio, self.max_feedback_drop))

    def next_step(self, ratio: float) -> float | None:
        """The first step above `ratio`; None when the canary is past the last one (then a
        passing window promotes it, if there are steps at all)."""
        return next((s for s in self.steps if s > ratio + STEP_EPSILON), None)

    def to_dict(self) -> dict[str, Any]:
        """JSON-able (audit details); `from_dict` reads it back."""
        data = asdict(self)
        data["steps"] = list(self.steps)
        return data

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> CanaryPolicy:
        return cls(**{**data, "steps": tuple(data.get("steps", ()))})


def _check_range(name: str, value: float | None, low: float, high: float) -> None:
    if value is None:
        return
    if math.isnan(value) or not low <= value <= high:
        raise InvalidArgument(f"{name} must lie in [{low:g}, {high:g}], got {value}")
