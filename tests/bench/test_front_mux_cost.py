"""bench.front_mux_cost: the worker front's own cost over a mux, measured on this CPU."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def test_a_level_times_the_fronts_steps_and_its_new_requests(tmp_path: Path) -> None:
    """Each variant (a task a stream; pumped, in one frame or 0.2 ms a frame) a level."""
    out = tmp_path / "front.json"
    res = subprocess.run(
        [sys.executable, "-m", "bench.front_mux_cost", "--streams", "8", "--step-ms", "5",
         "--new-tokens", "4", "--seconds", "1", "--deliveries", "task,pass", "--pump-ms",
         "0,0.2", "--out", str(out)],
        cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-3000:]
    result = json.loads(out.read_text())
    assert result["commit"] and result["host_cpu"]["cores"] >= 1
    assert [(lv["delivery"], lv["pump_ms"]) for lv in result["levels"]] == [
        ("task", 0), ("pass", 0), ("pass", 0.2)]
    for level in result["levels"]:
        # The closed loop kept going: every finished stream got a successor, each timed
        # from its up-frame to the core's add, and every delivered token was counted.
        assert level["streams"] == 8 and level["steps"] > 50
        assert level["requests"] > 8 * 4 and level["tokens"] >= 4 * (level["requests"] - 8)
        assert 0 < level["to_add_ms"]["p50"] <= level["to_add_ms"]["p90"] < 1000
        assert level["cpu_ms_per_step"] > 0 and 0 < level["loop_share"] < 2


@pytest.mark.parametrize("flag,value,says", [
    ("--streams", "0", "--streams must be 1 or more"),
    ("--streams", "64,x", "comma-separated numbers"),
    ("--wake-slices", "-1", "--wake-slices and --pump-ms 0 or more"),
    ("--pump-ms", "-0.5", "--wake-slices and --pump-ms 0 or more"),
    ("--deliveries", "pass,tasks", "--deliveries takes pass and/or task"),
    ("--step-ms", "0", "--step-ms must be positive"),
    ("--seconds", "-1", "--seconds must be positive"),
    ("--new-tokens", "0", "--new-tokens must be positive"),
])
def test_bad_flags_are_refused_before_anything_runs(flag: str, value: str, says: str) -> None:
    res = subprocess.run([sys.executable, "-m", "bench.front_mux_cost", flag, value],
                         cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert res.returncode == 2 and says in res.stderr, res.stderr[-1000:]
