"""bench.service_overhead's request lengths: all alike, or spread around --new-tokens by the
prompt (the same request asks for the same length on every path), and a bad spread refused."""

from __future__ import annotations

import subprocess
import sys

from bench.service_overhead import Lengths, workload


def test_lengths_alike_or_spread_by_the_prompt() -> None:
    prompts = [p for p, _ in workload([], 200, vocab=512)]
    assert {Lengths(64).of(p) for p in prompts} == {64}
    spread = [Lengths(64, 32).of(p) for p in prompts]
    assert min(spread) >= 32 and max(spread) <= 96
    assert len(set(spread)) > 40  # spread over the range, not a few values
    assert spread == [Lengths(64, 32).of(list(p)) for p in prompts]  # fixed by the prompt


def test_a_spread_as_wide_as_the_length_is_refused() -> None:
    res = subprocess.run([sys.executable, "-m", "bench.service_overhead", "--new-tokens", "8",
                          "--new-tokens-spread", "8"], capture_output=True, text=True, timeout=120)
    assert res.returncode == 2 and "--new-tokens-spread must be in [0, --new-tokens)" in res.stderr
