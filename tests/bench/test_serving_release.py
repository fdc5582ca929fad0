"""bench.serving frees each engine before it builds the next one and after every scenario:
on the H200 `--scenarios overhead,scale --arena-gb 90` ran out of GPU memory while the previous
scenario's engine (a 90 GB arena) was still alive. Real engines at the tiny shape; the warm-up
(compiling every decode shape, ~10 s each on a CPU) is left out, it holds no engine."""

from __future__ import annotations

import weakref
from pathlib import Path
from typing import Any

import pytest

import bench.serving as serving


def test_no_engine_outlives_its_scenario(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    built: list[weakref.ref[Any]] = []
    real = serving.LLMEngine

    def tracked(*args: Any, **kwargs: Any) -> Any:
        alive = [r for r in built if r() is not None]
        assert not alive, f"{len(alive)} engine(s) still alive while the next one is built"
        engine = real(*args, **kwargs)
        built.append(weakref.ref(engine))
        return engine

    def two_engines(b: serving.Bench) -> dict[str, Any]:
        # As 'scale' does: an engine per run, handed to the run and dropped by the scenario.
        steps = b.engine(2, (8,)).stats.steps
        return {"steps": steps + b.engine(2, (8, 16)).stats.steps}

    monkeypatch.setattr(serving, "LLMEngine", tracked)
    monkeypatch.setattr(serving, "warm", lambda *a, **k: None)
    monkeypatch.setitem(serving.SCENARIOS, "two", two_engines)
    out = tmp_path / "serving.json"
    assert serving.main(["--shape", "tiny", "--device", "cpu", "--dtype", "float32",
                         "--scenarios", "two,two", "--arena-gb", "0.01",
                         "--out", str(out)]) == 0
    assert len(built) == 4
    assert all(r() is None for r in built), "the last scenario's engine outlived main()"
    assert "error" not in out.read_text()
