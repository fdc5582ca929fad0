"""bench.serving's 'distinct' scenario writes its result after every repeat, so a run cut short
by its time limit (a fresh GPU machine compiling for minutes) still leaves what it measured,
marked `cut_short`; the final result has no mark and `met` needs every arm and repeat. Real
engines at the tiny shape on the CPU (the ride on, one adapter arm: about 10 s)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

import bench.serving as serving


def test_distinct_writes_each_repeat_marked_cut_short_until_the_last(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    out = tmp_path / "distinct.json"
    written: list[dict[str, Any]] = []
    real_dump = json.dump

    def recording_dump(obj: Any, f: Any, **kw: Any) -> None:
        if "distinct" in obj:
            written.append(json.loads(json.dumps(obj["distinct"], default=str)))
        real_dump(obj, f, **kw)

    monkeypatch.setattr(serving.json, "dump", recording_dump)
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert serving.main([
        "--shape", "tiny", "--device", "cpu", "--dtype", "float32", "--scenarios", "distinct",
        "--distinct-arms", "one_unmerged", "--ride-sole-adapter", "--distinct-batch", "4",
        "--distinct-input", "80", "--distinct-output", "4", "--overhead-repeats", "2",
        "--arena-gb", "0.2", "--one-adapter-rank", "16", "--out", str(out)]) == 0
    # Before the warm-up, after repeat 1 of 2, and the final result.
    assert [w.get("cut_short") for w in written] == ["0 of 2 repeats", "1 of 2 repeats", None]
    first, final = written[1], written[2]
    assert len(first["repeats"]) == 1 and len(final["repeats"]) == 2
    assert first["met"] is False  # a partial result never meets
    assert final["arms_left_out"] == ["distinct16", "distinct64"]
    assert final["met"] is False  # arms were left out
    assert final["one_unmerged"]["throughput_ratio"] > 0
    assert final["ride"]["ride_steps"] > 0  # the one-adapter arm rode
    # ... on a rank-16 adapter (--one-adapter-rank), its rows sized to it.
    assert final["one_adapter_rank"] == 16 and final["ride"]["rows_last_load"] == 16
    assert "one_kernels" in final
    assert json.loads(out.read_text())["distinct"]["repeats"] == final["repeats"]


@pytest.mark.parametrize("arms", ["", "distinct16,distinct32"])
def test_unknown_or_no_distinct_arms_are_refused_before_anything_is_built(
        arms: str, capfd: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exited:
        serving.main(["--device", "cpu", "--scenarios", "distinct", "--distinct-arms", arms])
    assert exited.value.code == 2
    err = capfd.readouterr().err
    assert "--distinct-arms" in err and "choose one or more of distinct16" in err
    if arms:
        assert "unknown: distinct32" in err


@pytest.mark.parametrize("full, arms, says", [
    ("one_unmerged", "distinct16", "choose from distinct16, distinct64"),
    ("distinct17", "distinct16", "unknown arms distinct17"),
])
def test_bad_full_list_arms_are_a_usage_error(full: str, arms: str, says: str,
                                              capfd: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exited:
        serving.main(["--device", "cpu", "--scenarios", "distinct", "--distinct-arms", arms,
                      "--full-list-arms", full])
    assert exited.value.code == 2 and says in capfd.readouterr().err


def test_full_list_arms_outside_the_arms_run_are_refused() -> None:
    with pytest.raises(SystemExit, match="--full-list-arms names arms not in --distinct-arms"):
        serving.main(["--shape", "tiny", "--device", "cpu", "--dtype", "float32",
                      "--scenarios", "distinct", "--distinct-arms", "one_unmerged",
                      "--full-list-arms", "distinct16", "--arena-gb", "0.2"])


@pytest.mark.parametrize("flag", ["--two-stage-arms", "--mixed-two-stage-arms"])
def test_two_stage_one_adapter_arm_is_refused_while_it_rides(flag: str) -> None:
    """--two-stage-arms (--mixed-two-stage-arms) one_unmerged stages the one-adapter arm's
    decode (mixed) tile lists; with the ride on that arm launches no tile kernel, so the pair
    is refused, naming both."""
    with pytest.raises(SystemExit, match=f"{flag}: one_unmerged rides with --ride-sole-adapter"):
        serving.main(["--shape", "tiny", "--device", "cpu", "--dtype", "float32",
                      "--scenarios", "distinct", "--distinct-arms", "one_unmerged",
                      "--ride-sole-adapter", flag, "one_unmerged", "--arena-gb", "0.2"])


def test_mixed_two_stage_arms_outside_the_arms_run_are_refused() -> None:
    with pytest.raises(SystemExit, match="--mixed-two-stage-arms names arms not in"):
        serving.main(["--shape", "tiny", "--device", "cpu", "--dtype", "float32",
                      "--scenarios", "distinct", "--distinct-arms", "one_unmerged",
                      "--mixed-two-stage-arms", "distinct16", "--arena-gb", "0.2"])


@pytest.mark.parametrize("flags, says", [
    (["--tile-variant-arms", "distinct16"], "--tile-variant-arms and --tile-variants go together"),
    (["--tile-variants", "k128"], "--tile-variant-arms and --tile-variants go together"),
    (["--tile-variant-arms", "distinct64", "--tile-variants", "k128"],
     "--tile-variant-arms names arms not in"),
])
def test_tile_variant_arms_need_their_variants_and_their_arms(flags: list[str],
                                                              says: str) -> None:
    with pytest.raises(SystemExit, match=says):
        serving.main(["--shape", "tiny", "--device", "cpu", "--dtype", "float32",
                      "--scenarios", "distinct", "--distinct-arms", "distinct16", *flags,
                      "--arena-gb", "0.2"])


def test_an_unknown_tile_variant_is_a_usage_error(capfd: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exited:
        serving.main(["--device", "cpu", "--scenarios", "distinct", "--tile-variant-arms",
                      "distinct16", "--tile-variants", "k128,k96"])
    assert exited.value.code == 2
    assert ("unknown tile variants k96 (choose from k128, n128cols4a, cols1, mixed_cols1)"
            in capfd.readouterr().err)
