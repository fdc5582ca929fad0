"""bench.lora_layer_fusion at toy sizes on the CPU (Triton's interpreter): every variant
computes the projection's base output plus the adapter's delta, checked against float64 torch,
the ops variants' fused expands against the unfused ones, other expand launch shapes
(--sweep-blocks) against the default's, and the JSON records each variant's time and error."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bench import lora_layer_fusion


def test_every_variant_computes_base_plus_delta(tmp_path: Path,
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("bench.kernels_timing.DEVICE", "cpu")
    monkeypatch.setattr(lora_layer_fusion, "DEVICE", "cpu")
    monkeypatch.setattr("bench.kernels_lora_grid.DEVICE", "cpu")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    for name in ("HIDDEN", "INTER", "PROJECTIONS", "HEAD_DIM"):  # --toy shrinks them: restored after
        monkeypatch.setattr(lora_layer_fusion, name, getattr(lora_layer_fusion, name))
    out = tmp_path / "fusion.json"
    assert lora_layer_fusion.main(["--toy", "--sweep-blocks", "32/8", "--out", str(out)]) == 0
    (row,) = json.loads(out.read_text())["rows"]
    for name in lora_layer_fusion.VARIANTS:
        assert row[f"{name}_rel_err"] < 2e-3, (name, row[f"{name}_rel_err"])
        assert row[f"{name}_us"] > 0
    # The expands fused into rotary and silu_mul give what the addmm and the plain ops give.
    for name in ("fused_ops_nopdl", "fused_ops_all_nopdl"):
        assert row[f"{name}_rel_err"] < 2e-3, (name, row[f"{name}_rel_err"])
    assert all(row[f"{name}_us"] > 0 for name in lora_layer_fusion.OPS_VARIANTS)
    # --sweep-blocks: the fused expands launched 32 rows and 8 warps a program give the
    # default launch's outputs, and are timed.
    assert row["default_blocks"] == [16, 4]
    assert row["fused_ops_all_m32_w8_rel_err"] < 1e-3
    assert "fused_ops_all_m32_w8_added_us" in row


@pytest.mark.parametrize("flag, value, says", [
    ("--cells", "64-64", "RANKxTOKENS"), ("--cells", "0x16", "positive"),
    ("--sweep-blocks", "16/x", "M/WARPS"), ("--sweep-blocks", "24/4,64/3", "24/4, 64/3"),
])
def test_bad_cells_and_launch_shapes_are_usage_errors(
        flag: str, value: str, says: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as e:
        lora_layer_fusion.main([flag, value])
    err = capsys.readouterr().err
    assert e.value.code == 2 and flag in err and says in err
