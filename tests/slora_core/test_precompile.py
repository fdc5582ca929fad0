"""slora_core.precompile: a start-up's kernels recorded by a dry forward and compiled side by
side. On the CPU: which launches the recording hook skips (only the warm-up thread's). On a
GPU: after `warmup()` precompiles, capturing the graphs compiles nothing more, and the
captured engine's greedy tokens equal an eager engine's."""

from __future__ import annotations

import threading
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from slora_core.config import EngineConfig
from slora_core.engine import LLMEngine
from slora_core.sampling_params import SamplingParams

pytest.importorskip("triton")


def _call(hook: Any, data: str, fn: object) -> bool | None:
    result: bool | None = hook(key="k", repr="r", fn=SimpleNamespace(jit_function=fn),
                               compile={"specialization_data": data}, is_manual_warmup=False,
                               already_compiled=False)
    return result


def test_only_the_entering_threads_launches_are_recorded_and_skipped() -> None:
    from triton import knobs

    from slora_core.precompile import MissingKernels

    calls: list[str] = []

    def previous(**kw: Any) -> None:
        calls.append(kw["compile"]["specialization_data"])

    kernel_a, kernel_b = object(), object()
    knobs.runtime.jit_cache_hook = previous
    try:
        with MissingKernels() as missing:
            hook = knobs.runtime.jit_cache_hook
            assert _call(hook, "a1", kernel_a) is True      # skipped: no compile, no launch
            assert _call(hook, "a1", kernel_a) is True      # the same one is recorded once
            assert _call(hook, "b1", kernel_b) is True
            other: list[bool | None] = []
            t = threading.Thread(target=lambda: other.append(_call(hook, "c1", kernel_a)))
            t.start()
            t.join()
            assert other == [None]  # another thread compiles and launches as usual
        assert missing.found == [(kernel_a, "a1"), (kernel_b, "b1")]
        assert calls == ["c1"]  # the hook that was installed still sees other threads
        assert knobs.runtime.jit_cache_hook is previous
    finally:
        knobs.runtime.jit_cache_hook = None


def test_a_failing_dry_forward_leaves_the_start_to_the_captures(caplog: pytest.LogCaptureFixture,
                                                                 ) -> None:
    from triton import knobs

    from slora_core.precompile import precompile_graphs

    ran: list[int] = []

    class Graphs:
        def dry_forward(self, key: int) -> None:
            ran.append(key)
            if key == 2:
                raise RuntimeError("no such bucket")

    assert precompile_graphs([(Graphs(), 1), (Graphs(), 2), (Graphs(), 3)]) >= 0
    assert ran == [1, 2] and "dry forwards failed" in caplog.text
    assert knobs.runtime.jit_cache_hook is None  # the recording hook is gone again
    assert precompile_graphs([]) == 0.0


def _greedy(engine: LLMEngine, adapters: list[str]) -> dict[str, list[int]]:
    params = SamplingParams(temperature=0, max_new_tokens=12, ignore_eos=True)
    for i, name in enumerate(["", *adapters] * 2):
        engine.add_request(str(i), [3 + i, 17, 42, 9, 100 + i] * (1 + i), params,
                           adapter=name or None)
    out: dict[str, list[int]] = {}
    while engine.has_unfinished():
        for o in engine.step():
            out.setdefault(o.request_id, []).extend(o.token_ids)
    return out


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_warmup_precompiles_every_kernel_the_capture_launches(demo_dir: Path, tmp_path: Path,
                                                              monkeypatch: pytest.MonkeyPatch,
                                                              ) -> None:
    import sys

    import triton

    from slora_core.compile_cache import CompileStats

    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path / "triton"))  # nothing on disk
    for name, module in list(sys.modules.items()):  # nor in memory (earlier tests' kernels)
        if name.startswith("slora_kernels"):
            for obj in vars(module).values():
                if isinstance(obj, triton.runtime.JITFunction):
                    for entry in obj.device_caches.values():
                        entry[0].clear()
    adapters = sorted(p.name for p in (demo_dir / "adapters").iterdir())[:3]

    def engine(graphs: bool) -> LLMEngine:
        e = LLMEngine.from_model_dir(demo_dir / "model", EngineConfig(
            device="cuda", dtype="float32", max_num_seqs=8, max_num_batched_tokens=96,
            cuda_graphs=graphs, mixed_graphs=graphs))
        for name in adapters:
            e.register_adapter(name, demo_dir / "adapters" / name)
        return e

    stats = CompileStats()
    stats.install()
    try:
        captured = engine(True)
        captured.warmup(True, background=True)
        before = stats.snapshot()
        seconds = captured.precompile_queued()
        precompiled = stats.since(before)
        while captured.capture_next_graph():
            pass
        during_capture = stats.since(before).compiled - precompiled.compiled
    finally:
        from triton import knobs

        knobs.compilation.listener = None
    assert seconds > 0 and precompiled.compiled + precompiled.cache_hits > 0, precompiled
    assert during_capture == 0
    eager = engine(False)
    assert _greedy(captured, adapters) == _greedy(eager, adapters)
