"""bench.lora_distinct_layer's command line: its cases and choices, and bad ones refused
before anything is built."""

from __future__ import annotations

import pytest

from bench import lora_distinct_layer as ldl


def test_cases_parse() -> None:
    assert ldl.parse_cases("16:8-16-32-64,65:8-64:chunk256") == [
        (16, (8, 16, 32, 64), 0), (65, (8, 64), 256)]


@pytest.mark.parametrize("bad", ["16", "16:8:chunk4:x", "16:8:tail4", "0:16", "1:16:chunk8",
                                 "4:0", "4:128", "x:16"])
def test_bad_cases_are_a_usage_error(bad: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as e:
        ldl.main(["--cases", bad])
    assert e.value.code == 2 and "--cases" in capsys.readouterr().err


def test_unknown_choices_are_a_usage_error(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as e:
        ldl.main(["--cases", "1:16", "--choices", "tiles,rowz"])
    err = capsys.readouterr().err
    assert e.value.code == 2 and "unknown rowz" in err and "tiles_short" in err
    with pytest.raises(SystemExit):  # mixed-step cases have their own choices
        ldl.main(["--cases", "2:16:chunk32", "--choices", "tiles"])


def test_choice_names_are_the_choices_built(monkeypatch: pytest.MonkeyPatch) -> None:
    from bench import kernels_lora_grid

    for mod in (ldl, kernels_lora_grid):
        monkeypatch.setattr(mod, "DEVICE", "cpu")
    # One adapter: its 4 tiles fit the short list (every choice but the middle list's).
    assert tuple(n for n in ldl.choices([0] * ldl.ROWS) if "@" not in n) == tuple(
        n for n in ldl.CHOICE_NAMES if n != "tiles_mid")
    assert "tiles_short" not in ldl.choices(list(range(ldl.ROWS)))  # 64 tiles: no short list
    sixteen = ldl.choices([i // 4 for i in range(ldl.ROWS)])  # 16 tiles: the middle list's
    assert "tiles_mid" in sixteen and "tiles_short" not in sixteen
    assert sixteen["tiles_mid"][0].num_tiles == 16 and sixteen["tiles"][0].num_tiles == 64
    assert sixteen["tiles_bound"][0].num_tiles == 33  # beside the row kernels: 31 + 33 // 16
    # tiles@L/S: every length the real tiles fit, each with every such length's split.
    assert {n for n in sixteen if "@" in n} == {f"tiles@{a}/{b}" for a in ldl.SIZES
                                                  for b in ldl.SIZES}
    assert sixteen["tiles@bound/full"][0].num_tiles == 33
    assert "tiles@mid/real" not in ldl.choices([i // 3 for i in range(ldl.ROWS)])  # 22 real
    wide = ldl.choices([i // 4 for i in range(256)])  # 64 tiles on 256 rows: the middle list
    assert wide["tiles_mid"][0].num_tiles == 64 and wide["tiles"][0].num_tiles == 256
    assert wide["tiles_bound"][0].num_tiles == 135
    assert "tiles_bound" not in ldl.choices(list(range(ldl.ROWS)))  # 64 real tiles
    # What decode graphs replay: the shortest list that fits, the split for its own length
    # up to 16 tiles, past that for the bucket's rows (up to 64) or the longest list.
    graph = {n: ldl.choices([i * n // r for i in range(r)])["tiles_graph"][0]
             for n, r in ((16, 64), (20, 64), (64, 256))}
    assert [(m.num_tiles, m.split_tiles) for m in graph.values()] == [
        (16, 16), (33, 64), (64, 135)]
    assert "tiles_graph" not in ldl.choices(list(range(ldl.ROWS)))  # a row each: row kernels
    assert tuple(ldl.mixed_choices([0] * ldl.ROWS + [1] * 16, ldl.ROWS)) == (
        ldl.MIXED_CHOICE_NAMES)


@pytest.mark.parametrize("rows", ["0", "15"])
def test_rows_fewer_than_the_adapters_is_a_usage_error(
        rows: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as e:
        ldl.main(["--cases", "16:8", "--rows", rows])
    assert e.value.code == 2 and "--rows" in capsys.readouterr().err


@pytest.mark.parametrize("flag", [["--profile-steps", "0"], ["--distinct-input", "32"]])
def test_distinct_scenario_flags_out_of_range_are_a_usage_error(
        flag: list[str], capfd: pytest.CaptureFixture[str]) -> None:
    from bench.serving import main

    # capfd, not capsys: bench.serving registers faulthandler on the real stderr.
    with pytest.raises(SystemExit) as e:
        main(["--scenarios", "distinct_profile", *flag])
    assert e.value.code == 2 and flag[0] in capfd.readouterr().err
