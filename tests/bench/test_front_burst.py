"""bench.front_burst at a tiny load: probes are answered at a step and timed both ways, the
load streams keep reading, and bad arguments are usage errors."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bench import front_burst


def test_probes_are_timed_beside_running_streams(tmp_path: Path) -> None:
    out = tmp_path / "burst.json"
    assert front_burst.main(["--concurrency", "4", "--step-ms", "5", "--chunks", "all,2",
                             "--probe-rate", "40", "--seconds", "1.5", "--settle-s", "0.3",
                             "--repeats", "1", "--out", str(out)]) == 0
    result = json.loads(out.read_text())
    assert result["complete"] and [r["chunk"] for r in result["rows"]] == ["all", 2]
    for row in result["rows"]:
        assert row["probes"] > 5
        # Four streams, a message each every 5 ms, for 2.5 s: at least half of it arrives.
        assert row["load_messages"] > 4 * 250
        for leg in ("way_in_ms", "way_back_ms", "probe_total_ms"):
            assert 0 < row[leg]["p50"] <= row[leg]["p90"]
        # A probe waits for a step: its whole time is at least its two ways.
        assert row["probe_total_ms"]["mean"] > row["way_in_ms"]["mean"]


@pytest.mark.parametrize("bad", [["--chunks", "all,x"], ["--chunks", "-1"],
                                 ["--concurrency", "0"], ["--seconds", "1", "--settle-s", "2"]])
def test_bad_arguments_are_usage_errors(bad: list[str]) -> None:
    with pytest.raises(SystemExit) as e:
        front_burst.main(bad)
    assert e.value.code == 2
