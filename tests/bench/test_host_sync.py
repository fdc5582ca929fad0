"""bench.host_sync (`bench.serving --scenarios hostsync`) runs end to end on the CPU at the tiny
shape, every mode with both copy paths, and its baseline arm patches the old copies in for
its run only."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

import slora_core.sampler as sampler_module
import slora_core.step_loop as step_loop_module
from bench import serving
from bench.host_sync import MODES, old_copies
from slora_core import host_copy

ROOT = Path(__file__).resolve().parents[2]


def test_the_old_copies_are_patched_in_for_the_run_only() -> None:
    with old_copies():
        assert sampler_module.host_values is not host_copy.host_values
        assert step_loop_module.row_index is not host_copy.row_index
    assert sampler_module.host_values is host_copy.host_values
    assert sampler_module.row_index is host_copy.row_index
    assert step_loop_module.row_index is host_copy.row_index


def test_every_mode_runs_with_both_copies(tmp_path: Path) -> None:
    out = tmp_path / "hostsync.json"
    res = subprocess.run(
        [sys.executable, "-m", "bench.serving", "--shape", "tiny", "--device", "cpu",
         "--scenarios", "hostsync", "--hostsync-streams", "4",
         "--hostsync-requests-per-stream", "2", "--hostsync-new-tokens", "4",
         "--hostsync-repeats", "1", "--arena-gb", "0.05", "--out", str(out)],
        cwd=ROOT, capture_output=True, text=True, timeout=240)
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-3000:]
    got = json.loads(out.read_text())["hostsync"]
    assert "error" not in got, got
    for mode in MODES:
        for copies in ("sync", "pinned"):
            (run,) = got["runs"][mode][copies]
            assert run["output_tokens"] == 8 * 4, (mode, copies)
        assert math.isfinite(got[mode]["throughput_ratio_pinned_over_sync"]) and got[mode][
            "throughput_ratio_pinned_over_sync"] > 0


@pytest.mark.parametrize("flag", ["--hostsync-streams", "--hostsync-requests-per-stream",
                                  "--hostsync-new-tokens", "--hostsync-repeats"])
def test_a_count_below_one_is_refused_naming_the_flag(
        flag: str, capfd: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        serving.main(["--shape", "tiny", "--device", "cpu", "--scenarios", "hostsync", flag, "0"])
    assert exc.value.code == 2
    assert f"{flag} must be 1 or more, got 0" in capfd.readouterr().err
