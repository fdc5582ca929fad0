"""bench.closed_loop_waves on the demo engine: fixed-length streams started together move in
lockstep (each wave of next requests lands before one step), spread lengths break the waves."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bench.closed_loop_waves import main


def test_fixed_lengths_run_in_waves_and_spread_lengths_do_not(tmp_path: Path) -> None:
    out = tmp_path / "waves.json"
    assert main(["--concurrency", "4", "--requests-per-stream", "3", "--new-tokens", "6",
                 "--spreads", "0,4", "--out", str(out)]) == 0
    result = json.loads(out.read_text())
    assert {"command", "commit", "hardware"} <= set(result)
    fixed, spread = result["arms"]
    assert fixed["requests"] == spread["requests"] == 12
    # 4 streams of 6 tokens each, started in one step: every wave is all 4, 3 waves
    assert fixed["adds_histogram"] == {"4": 3}
    assert sum(fixed["steps_add_to_first_token"].values()) == 12
    assert spread["steps_with_adds"] > fixed["steps_with_adds"]


def test_a_spread_as_wide_as_the_length_is_a_usage_error(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        main(["--new-tokens", "6", "--spreads", "0,6"])
    assert exc.value.code == 2
    assert "every spread must be in [0, --new-tokens=6)" in capsys.readouterr().err
