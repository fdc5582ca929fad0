"""bench.prefix_cache runs end to end at the tiny shape on the CPU (--smoke): both arms of both
workloads, a JSON with the commit, command and hardware, the cache hitting on later turns."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bench import prefix_cache


@pytest.mark.slow
def test_smoke_run_writes_both_arms(tmp_path: Path) -> None:
    out = tmp_path / "prefix-cache.json"
    assert prefix_cache.main(["--smoke", "--out", str(out)]) == 0
    result = json.loads(out.read_text())
    assert {"commit", "command", "hardware"} <= set(result)
    assert "--smoke" in result["command"]
    on, off = result["chat"]["cache_on"], result["chat"]["cache_off"]
    assert on["requests"] == off["requests"] == 4 * 3
    assert on["prefix_cache_hits"] > 0 and off["prefix_cache_hits"] == 0
    assert 0 < on["hit_rate"] <= 1 and on["cached_tokens_reported"] > 0
    assert set(on["evictions"]) == {"prefix_pages", "adapters"}
    assert result["unshared"]["cache_on"]["prefix_cache_hits"] == 0
    assert set(result["targets"]) == {"ttft_p50_3x_lower", "throughput_1.5x_higher",
                                      "unshared_loses_at_most_1pct"}
