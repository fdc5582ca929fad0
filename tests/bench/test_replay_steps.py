"""bench.replay's step breakdown: decode-only steps and steps with prompt chunks apart, each
split at the median count of distinct adapters."""

from __future__ import annotations

from bench.replay import step_kinds


def test_step_kinds_split_decode_and_mixed_steps_at_the_adapter_median() -> None:
    # (wall s, tokens, prompt-chunk tokens) and each step's distinct adapters.
    steps = [(0.010, 8, 0), (0.012, 8, 0), (0.030, 8, 0), (0.050, 300, 292), (0.070, 310, 300)]
    distinct = [2, 3, 9, 4, 12]
    out = step_kinds(steps, distinct)
    assert out["adapters_median"] == 4.0
    assert out["decode"]["steps"] == 3 and out["mixed"]["steps"] == 2
    assert out["decode_few_adapters"]["steps"] == 2
    assert out["decode_many_adapters"] == {
        "steps": 1, "step_s": {"p50": 0.030, "p90": 0.030, "p99": 0.030},
        "tokens_mean": 8.0, "adapters_mean": 9.0}
    assert out["mixed_few_adapters"]["adapters_mean"] == 4.0
    assert out["mixed_many_adapters"]["tokens_mean"] == 310.0
    assert abs(out["mixed"]["step_s"]["p50"] - 0.060) < 1e-12


def test_no_steps_no_breakdown() -> None:
    assert step_kinds([], []) == {}
