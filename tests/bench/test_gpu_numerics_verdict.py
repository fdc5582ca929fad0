"""bench.gpu_numerics' verdict when gpu_checks splits it into one process per dtype and mode
and one for the guard: each piece is required where it was asked for (--pieces) and nowhere
else; the guard only in its mode (all_graphs on a GPU)."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest

from bench import gpu_checks, gpu_numerics
from bench.gpu_numerics import verdict

FAITHFUL = {"tokens_from_nonfinite_rows": 0, "nonfinite_rows_met": 0,
            "hf_same_dtype_nonfinite_rows": 0, "agreement": {"faithful": True}}
GUARD = {"others_finished_with_all_tokens": True, "others_vs_hf": {"agreement": {
    "faithful": True}}, "tokens_from_nonfinite_rows": 0,
    "poisoned_request": {"tokens": 0, "finish_reason": "error"},
    "forced_nan_request": {"tokens": 2, "finish_reason": "error"}}


def report(modes: list[str], pieces: dict[str, Any],
           planned: tuple[str, ...] = ("modes", "ops", "guard")) -> dict[str, Any]:
    return {"modes": modes, "guard_mode": "all_graphs", "pieces": list(planned),
            "strengths": [{"dtypes": {"float16": pieces}}]}


def test_a_mode_without_the_guard_passes_without_it() -> None:
    r = report(["eager"], {"eager": FAITHFUL, "ops": {}})
    assert verdict(r) and r["guard_ok"] and r["skipped"] == 0


def test_all_graphs_without_its_guard_fails() -> None:
    r = report(["all_graphs"], {"all_graphs": FAITHFUL, "ops": {}})
    assert not verdict(r) and not r["guard_ok"]


def test_a_skipped_guard_fails() -> None:
    r = report(["all_graphs"], {"all_graphs": FAITHFUL, "ops": {},
                                "guard": {"skipped": "time budget 245 s"}})
    assert not verdict(r) and r["skipped"] == 1


def test_a_guard_that_let_a_poisoned_request_through_fails() -> None:
    bad = GUARD | {"poisoned_request": {"tokens": 3, "finish_reason": "length"}}
    ok = report(["all_graphs"], {"all_graphs": FAITHFUL, "ops": {}, "guard": GUARD})
    assert verdict(ok) and ok["guard_ok"]
    r = report(["all_graphs"], {"all_graphs": FAITHFUL, "ops": {}, "guard": bad})
    assert not verdict(r) and not r["guard_ok"]


def test_all_graphs_asked_for_its_requests_alone_passes_without_the_guard() -> None:
    r = report(["all_graphs"], {"all_graphs": FAITHFUL}, planned=("modes",))
    assert verdict(r) and r["guard_ok"]
    unfaithful = FAITHFUL | {"agreement": {"faithful": False}}
    r = report(["all_graphs"], {"all_graphs": unfaithful}, planned=("modes",))
    assert not verdict(r) and not r["faithful_ok"]


def test_a_guard_process_is_judged_by_its_guard() -> None:
    r = report(["all_graphs"], {"guard": GUARD}, planned=("guard",))
    assert verdict(r) and r["guard_ok"] and r["faithful_ok"]
    r = report(["all_graphs"], {}, planned=("guard",))  # cut short before the guard ended
    assert not verdict(r) and not r["guard_ok"]
    leaky = GUARD | {"forced_nan_request": {"tokens": 5, "finish_reason": "length"}}
    r = report(["all_graphs"], {"guard": leaky}, planned=("guard",))
    assert not verdict(r)


def test_a_mode_asked_for_but_never_run_fails() -> None:
    r = report(["all_graphs_async"], {}, planned=("modes",))
    assert not verdict(r) and not r["faithful_ok"]


def test_gpu_numerics_refuses_a_guard_without_its_mode(
        capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(sys, "argv", ["gpu_numerics", "--modes", "eager", "--pieces", "guard"])
    with pytest.raises(SystemExit) as exc:
        gpu_numerics.main()
    assert exc.value.code == 2
    assert "--pieces guard runs in all_graphs: add it to --modes" in capsys.readouterr().err


def test_gpu_checks_refuses_an_unknown_numerics_mode(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        gpu_checks.main(["A", "--out", str(tmp_path), "--numerics-modes", "eager", "graphs"])
    assert exc.value.code == 2
    assert "--numerics-modes: unknown ['graphs']" in capsys.readouterr().err
    assert not list(tmp_path.iterdir())  # refused before any process started
