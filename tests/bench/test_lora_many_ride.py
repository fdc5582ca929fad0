"""bench.lora_many_ride at toy sizes on the CPU (Triton's interpreter): with 16 adapters'
A rows appended to the base weights, the wide GEMM, the gather and today's expand give each
token its own adapter's delta, as the LoRA launches do (both against float64 torch). Slow:
about 30 s in the interpreter."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bench import lora_many_ride


@pytest.mark.slow
def test_many_ride_gives_each_token_its_own_adapters_delta(tmp_path: Path,
                                                           monkeypatch: pytest.MonkeyPatch):
    for mod in ("bench.kernels_timing", "bench.lora_many_ride", "bench.lora_distinct_layer",
                "bench.kernels_lora_grid"):
        monkeypatch.setattr(f"{mod}.DEVICE", "cpu")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    out = tmp_path / "many.json"
    assert lora_many_ride.main(["--shape", "toy", "--adapters", "16", "--out", str(out)]) == 0
    (row,) = json.loads(out.read_text())["rows_out"]
    assert row["lora_path"] == "tiles" and row["rows_per_adapter"] == 4
    # Appended rows: qkv's 3 modules x (8 + 16 + 32 + 64) x 4 adapters of each rank = 1440.
    assert row["extra_gemm_rows"] == {"(0, 1, 2)": 1440, "(3,)": 480, "(4, 5)": 960,
                                      "(6,)": 480}
    for name in ("base", "kernels", "many_ride"):
        assert row[f"{name}_rel_err"] < 2e-3, (name, row[f"{name}_rel_err"])
    assert all(row[f"{name}_us"] > 0 for name in lora_many_ride.VARIANTS)
    with pytest.raises(SystemExit):
        lora_many_ride.main(["--adapters", "12"])  # 12 does not divide 64 rows
