"""bench.profile_core times each phase of the engine core's step inside the real `EngineCore`
loop: the phases it wraps must still be the ones the step runs (a refactor that moves one
would otherwise leave the bench failing only when next run on the GPU)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_every_phase_of_a_cpu_decode_step_is_timed(tmp_path: Path) -> None:
    out = tmp_path / "profile.json"
    res = subprocess.run(
        [sys.executable, "-m", "bench.profile_core", "--batch", "4", "--context", "8",
         "--warm-steps", "2", "--steps", "3", "--num-pages", "64", "--out", str(out)],
        cwd=ROOT, capture_output=True, text=True, timeout=240)
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-3000:]
    result = json.loads(out.read_text())
    assert len(result["steps"]) == 3 and result["batch"] == 4
    median = result["median_ms"]
    # Synchronous steps on the CPU: the sampled ids are read at once, so no read wait.
    for phase in ("schedule", "inputs", "forward_launch", "sample", "book", "output_send"):
        assert median[phase] > 0.0, phase
    assert median["step_total"] >= median["forward_launch"] + median["book"]
