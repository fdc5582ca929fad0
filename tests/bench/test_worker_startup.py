"""bench.worker_startup's smoke mode on the CPU: two real worker processes (cold, then warm on
the compile cache the first left) each serve a token, and the JSON carries the command,
hardware, commit and every start's profile."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bench import worker_startup

pytestmark = [pytest.mark.slow, pytest.mark.timeout(400)]


def test_smoke_run_times_cold_and_warm_starts(tmp_path: Path,
                                              monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SLORA_COMMIT", "smoke-commit")
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    out = tmp_path / "startup.json"
    assert worker_startup.main(["--smoke", "--out", str(out)]) == 0
    result = json.loads(out.read_text())
    assert result["commit"] == "smoke-commit" and result["hardware"] == "cpu"
    assert result["command"].startswith("python -m bench.worker_startup --smoke")
    tiny = result["models"]["tiny"]
    assert tiny["dtype"] == "float32"
    for kind in ("cold", "warm"):
        start = tiny[kind]
        assert start["served"], start
        phases = start["phases"]
        # The phases that apply on a CPU; no graphs are captured there.
        assert {"process", "core_spawn", "weights", "arena", "warmup", "server",
                "ready"} <= set(phases), phases
        assert "graph_capture" not in phases and start["graphs"] == {}
        assert all(v >= 0 for v in phases.values())
        # The worker's own clock starts at its process creation, a moment after the bench's.
        assert 0 < phases["ready"] <= start["first_token_s"] + 0.5
        assert phases["ready"] >= phases["weights"] + phases["warmup"]
        assert start["kernels"] == {"compiled": 0, "cache_hit": 0}  # the CPU runs no Triton
