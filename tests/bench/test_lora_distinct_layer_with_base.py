"""bench.lora_distinct_layer --with-base at toy sizes on the CPU (Triton's interpreter): the
base GEMM written into y, then the LoRA launch pairs of `lora_groups`, give x @ W.T plus the
delta torch's reference adds; the command line runs the arms and records them (on the CPU
the fork arms run in line: no streams). Slow: about 20 s in the interpreter."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from bench import lora_distinct_layer as ldl
from slora_kernels.lora_reference import add_lora_reference


@pytest.fixture
def cpu(monkeypatch: pytest.MonkeyPatch) -> None:
    for mod in ("bench.kernels_timing", "bench.lora_distinct_layer", "bench.kernels_lora_grid"):
        monkeypatch.setattr(f"{mod}.DEVICE", "cpu")
    monkeypatch.setenv("TRITON_INTERPRET", "1")


@pytest.mark.slow
@pytest.mark.usefixtures("cpu")
def test_base_gemm_then_lora_groups_match_torch() -> None:
    shape = ldl.SHAPES["toy"]
    gen = torch.Generator().manual_seed(1)
    slots = [i * 4 // ldl.ROWS for i in range(ldl.ROWS)]
    lay = ldl.build_layer(shape, 4, (8, 16), gen)
    ws = ldl.base_weights(shape, gen)
    ldl.with_base_calls(lay, shape, ldl.choices(slots)["tiles"], ws, None)()
    for (_, mods, _, outs), x, y, w in zip(shape.projections(), lay.xs, lay.ys, ws,
                                           strict=True):
        ref = torch.mm(x.float(), w.float().T)
        starts = [sum(outs[:i]) for i in range(len(outs))]
        meta = ldl.LoraMeta.from_token_slots(slots, block_m=ldl.DECODE_BLOCK_M)
        add_lora_reference(ref, x.float(), lay.arena.float(), lay.a_offsets, lay.b_offsets,
                           lay.ranks, lay.scales, mods, tuple(zip(starts, outs, strict=True)),
                           meta)
        err = (y.float() - ref).abs().max() / ref.abs().max()
        assert err < 2e-3, (mods, float(err))


@pytest.mark.slow
@pytest.mark.usefixtures("cpu")
def test_with_base_records_each_arm(tmp_path: Path) -> None:
    out = tmp_path / "with-base.json"
    assert ldl.main(["--shape", "toy", "--cases", "4:8-16", "--choices", "tiles",
                     "--with-base", "--out", str(out)]) == 0
    (row,) = json.loads(out.read_text())["rows_out"]
    for key in ("base_layer_us", "tiles+base_us", "tiles+base_fork_us",
                "tiles+base_fork_high_us"):
        assert row[key] > 0, key
    # On the CPU the fork arms run in line (no streams): whether the fork matches is a GPU
    # question (the GPU test of decode graphs compares them bit for bit); here it is recorded.
    assert "tiles_fork_matches" in row


@pytest.mark.slow
@pytest.mark.usefixtures("cpu")
def test_whole_lora_into_a_delta_then_added_matches_torch() -> None:
    """--fork-all's arms (in line on the CPU): with the add y is x @ W.T plus torch's delta;
    without it y is the base GEMM's alone, which that delta visibly moves."""
    shape = ldl.SHAPES["toy"]
    gen = torch.Generator().manual_seed(2)
    slots = [i * 4 // ldl.ROWS for i in range(ldl.ROWS)]
    lay = ldl.build_layer(shape, 4, (8, 16), gen)
    ws = ldl.base_weights(shape, gen)
    choice = ldl.choices(slots)["tiles"]
    meta = ldl.LoraMeta.from_token_slots(slots, block_m=ldl.DECODE_BLOCK_M)
    for mode in ("add", "noadd"):
        ldl.with_base_calls(lay, shape, choice, ws, None, mode)()
        for (_, mods, _, outs), x, y, w in zip(shape.projections(), lay.xs, lay.ys, ws,
                                               strict=True):
            base = torch.mm(x.float(), w.float().T)
            ref = base.clone()
            starts = [sum(outs[:i]) for i in range(len(outs))]
            add_lora_reference(ref, x.float(), lay.arena.float(), lay.a_offsets,
                               lay.b_offsets, lay.ranks, lay.scales, mods,
                               tuple(zip(starts, outs, strict=True)), meta)
            lora = (ref - base).abs().max()
            want = ref if mode == "add" else base
            err = (y.float() - want).abs().max()
            assert err < 2e-3 * ref.abs().max(), (mode, mods, float(err))
            assert lora > 20 * err, (mode, mods, float(lora), float(err))


@pytest.mark.slow
@pytest.mark.usefixtures("cpu")
def test_fork_all_records_its_arms(tmp_path: Path) -> None:
    out = tmp_path / "fork-all.json"
    assert ldl.main(["--shape", "toy", "--cases", "4:8-16", "--choices", "tiles",
                     "--with-base", "--fork-all", "--out", str(out)]) == 0
    (row,) = json.loads(out.read_text())["rows_out"]
    for key in ("tiles+base_forkall_add_us", "tiles+base_forkall_noadd_us"):
        assert row[key] > 0, key
    assert row["tiles_forkall_rel_diff"] < 2e-3


def test_fork_all_needs_with_base(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        ldl.main(["--shape", "toy", "--cases", "4:8-16", "--fork-all"])
    assert "--fork-all needs --with-base" in capsys.readouterr().err
