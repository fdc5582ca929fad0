"""bench.grpc_end_lag at a tiny load: every call's chunks and its end arrive and are timed,
and bad arguments are usage errors."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bench import grpc_end_lag


def test_every_end_arrives_and_each_kind_is_timed(tmp_path: Path) -> None:
    out = tmp_path / "lag.json"
    assert grpc_end_lag.main(["--concurrency", "2,3", "--calls", "1", "--step-ms", "1",
                              "--repeats", "1", "--out", str(out)]) == 0
    result = json.loads(out.read_text())
    assert result["complete"] and [r["concurrency"] for r in result["rows"]] == [2, 3]
    for row in result["rows"]:
        assert row["calls"] == row["concurrency"]
        lags = [row[f"{k}_p50_ms"] for k in grpc_end_lag.KINDS]
        assert all(0 < lag < 1000 for lag in lags), lags
        # the call's end comes after its complete, which comes after the last chunk
        assert row["call_end_p50_ms"] >= row["complete_p50_ms"] >= row["last_chunk_p50_ms"]


@pytest.mark.parametrize("bad", [["--concurrency", "0"], ["--concurrency", "a"],
                                 ["--step-ms", "0"], ["--calls", "0"]])
def test_bad_arguments_are_usage_errors(bad: list[str]) -> None:
    with pytest.raises(SystemExit) as e:
        grpc_end_lag.main(bad)
    assert e.value.code == 2
