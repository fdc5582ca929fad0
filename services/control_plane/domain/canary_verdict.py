"""Judging one analysis window: canary evidence against stable evidence under a policy.

Pure (no I/O, no clock), so the rules are tested directly:
- Nothing is decided before the canary has `min_requests` requests in the window (as counted
  by workers or by gateways, whichever saw more).
- A breach of any check that has enough data rolls back at once, even mid-window: waiting
  would only send more traffic to a version already shown to be worse.
- A window passes when it has lasted `window_s`, every configured check had enough data and
  none was breached. A check without enough data holds the window open (it keeps collecting)
  rather than passing blind.

Checks (each off when its threshold is None):
- failure rate increase: canary failure rate (`Evidence.failure_rate`: worker errors,
  non-finite and empty outputs, gateway fallbacks and client errors) minus stable's (0 when
  the stable version had no requests); needs only the canary's requests.
- TTFT and TPOT ratios: canary mean / stable mean; each side needs `min_requests` samples.
- feedback drop: stable mean score minus canary mean score; each side needs `min_feedback`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from services.common.versions import Evidence
from services.control_plane.domain.canary_policy import CanaryPolicy

BREACH, PASS, WAIT = "breach", "pass", "wait"


@dataclass(frozen=True)
class Check:
    name: str
    threshold: float
    measured: float | None  # None: not enough data
    needs: str = ""         # what is missing when measured is None

    @property
    def breached(self) -> bool:
        return self.measured is not None and self.measured > self.threshold

    def to_dict(self) -> dict[str, Any]:
        return {"check": self.name, "threshold": self.threshold, "measured": self.measured,
                "breached": self.breached, **({"needs": self.needs} if self.needs else {})}

    def describe(self) -> str:
        return f"{self.name} {self.measured:.3g} > {self.threshold:g}"


@dataclass(frozen=True)
class Verdict:
    kind: str                 # BREACH, PASS or WAIT
    checks: tuple[Check, ...]
    waiting_for: str = ""     # WAIT: what is missing

    @property
    def crossed(self) -> tuple[Check, ...]:
        return tuple(c for c in self.checks if c.breached)

    def reason(self) -> str:
        if self.kind == BREACH:
            return "canary analysis: " + "; ".join(c.describe() for c in self.crossed)
        if self.kind == PASS:
            return "canary analysis: window passed (" + ", ".join(
                f"{c.name} {c.measured:.3g} <= {c.threshold:g}" for c in self.checks) + ")"
        return f"canary analysis: waiting for {self.waiting_for}"


def judge(policy: CanaryPolicy, canary: Evidence, stable: Evidence, elapsed_s: float) -> Verdict:
    """The verdict on a window that has lasted `elapsed_s` seconds so far."""
    if canary.samples < policy.min_requests:
        return Verdict(WAIT, (), f"{canary.samples}/{policy.min_requests} canary requests")
    checks = tuple(_checks(policy, canary, stable))
    if any(c.breached for c in checks):
        return Verdict(BREACH, checks)
    missing = [f"{c.name}: {c.needs}" for c in checks if c.measured is None]
    if missing:
        return Verdict(WAIT, checks, "; ".join(missing))
    if elapsed_s < policy.window_s:
        return Verdict(WAIT, checks, f"the window to end ({elapsed_s:.1f}/{policy.window_s:g} s)")
    return Verdict(PASS, checks)


def _checks(policy: CanaryPolicy, canary: Evidence, stable: Evidence) -> list[Check]:
    checks = []
    if policy.max_error_rate_increase is not None:
        increase = (canary.failure_rate or 0.0) - (stable.failure_rate or 0.0)
        checks.append(Check("failure_rate_increase", policy.max_error_rate_increase, increase))
    n = policy.min_requests
    for name, threshold, c_hist, s_hist in (
            ("ttft_ratio", policy.max_ttft_ratio, canary.ttft, stable.ttft),
            ("tpot_ratio", policy.max_tpot_ratio, canary.tpot, stable.tpot)):
        if threshold is None:
            continue
        c_mean, s_mean = c_hist.mean(), s_hist.mean()
        if c_hist.count < n or s_hist.count < n or not s_mean or c_mean is None:
            checks.append(Check(name, threshold, None,
                                f"{n} samples each (canary {c_hist.count}, stable {s_hist.count})"))
        else:
            checks.append(Check(name, threshold, c_mean / s_mean))
    if policy.max_feedback_drop is not None:
        k = policy.min_feedback
        c_fb, s_fb = canary.feedback_mean, stable.feedback_mean
        if canary.feedback_count < k or stable.feedback_count < k or c_fb is None or s_fb is None:
            checks.append(Check("feedback_drop", policy.max_feedback_drop, None,
                                f"{k} scores each (canary {canary.feedback_count}, "
                                f"stable {stable.feedback_count})"))
        else:
            checks.append(Check("feedback_drop", policy.max_feedback_drop, s_fb - c_fb))
    return checks
