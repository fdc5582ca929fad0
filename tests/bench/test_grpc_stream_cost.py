"""bench.grpc_stream_cost at a tiny load: the server streams every message it is asked for,
its CPU is charged per message, and bad arguments are usage errors."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bench import grpc_stream_cost


def test_every_message_arrives_and_is_charged(tmp_path: Path) -> None:
    out = tmp_path / "cost.json"
    assert grpc_stream_cost.main(["--concurrency", "3", "--messages", "4", "--step-ms", "2",
                                  "--repeats", "1", "--servers", "aio_yield,sync",
                                  "--out", str(out)]) == 0
    result = json.loads(out.read_text())
    assert result["complete"] and [r["server"] for r in result["rows"]] == ["aio_yield", "sync"]
    for row in result["rows"]:
        assert row["messages"] == 12 and row["wall_s"] > 0
        assert row["server_cpu_s"] >= 0 and row["server_cpu_us_per_message"] >= 0


@pytest.mark.parametrize("bad", [["--servers", "aio_yeld"], ["--concurrency", "0"],
                                 ["--step-ms", "0"]])
def test_bad_arguments_are_usage_errors(bad: list[str]) -> None:
    with pytest.raises(SystemExit) as e:
        grpc_stream_cost.main(bad)
    assert e.value.code == 2
