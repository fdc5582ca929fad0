"""bench.profile_core times each phase of the engine core's step inside the real `EngineCore`
loop: the phases it wraps must still be the ones the step runs (a refactor that moves one
would otherwise leave the bench failing only when next run on the GPU)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def run(tmp_path: Path, *extra: str) -> dict:
    out = tmp_path / "profile.json"
    res = subprocess.run(
        [sys.executable, "-m", "bench.profile_core", "--batch", "4", "--context", "8",
         "--warm-steps", "2", "--steps", "3", "--num-pages", "64", *extra, "--out", str(out)],
        cwd=ROOT, capture_output=True, text=True, timeout=240)
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-3000:]
    return json.loads(out.read_text())


def test_every_phase_of_a_cpu_decode_step_is_timed(tmp_path: Path) -> None:
    result = run(tmp_path)
    assert result["batch"] == 4 and list(result["arms"]) == ["on"]
    (only,) = result["arms"]["on"]
    assert len(only["steps"]) == 3
    median = only["median_ms"]
    # Synchronous steps on the CPU: the sampled ids are read at once, so no read wait.
    for phase in ("schedule", "inputs", "forward_launch", "sample", "book", "output_send"):
        assert median[phase] > 0.0, phase
    assert median["step_total"] >= median["forward_launch"] + median["book"]
    assert "read_to_send" not in median  # synchronous steps read no earlier step's ids


def test_async_steps_time_the_read_to_the_send_with_early_outputs_and_without(
        tmp_path: Path) -> None:
    result = run(tmp_path, "--async-steps", "--early-outputs", "on,off", "--steps", "8")
    early, late = (result["arms"][arm][0]["steps"] for arm in ("on", "off"))
    assert len(early) == len(late) == 8
    assert all(step["read_to_send"] > 0 for step in early + late)
    # Without early outputs the next step's sampling runs between the read and the send, in
    # every step (an order, not a speed: which arm is faster is the bench's to measure).
    assert all(step["read_to_send"] >= step["sample"] for step in late)
