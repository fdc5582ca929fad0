"""A CUDA-graph capture met mid-serving survives what else the process does meanwhile: Python's
garbage collector freeing a dead engine's graphs (H200, gpu_numerics bf16 asynchronous steps:
cudaErrorStreamCaptureInvalidated), and other threads' CUDA calls."""

from __future__ import annotations

import gc
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
import torch

from slora_core.config import EngineConfig
from slora_core.engine import LLMEngine


def _mixed_graphs(demo_dir: Path, device: str) -> Any:
    from slora_core.cuda_graphs import MixedGraphs

    engine = LLMEngine.from_model_dir(demo_dir / "model", EngineConfig(
        device=device, max_num_batched_tokens=48, max_num_seqs=8, cuda_graphs=False))
    return engine, MixedGraphs(engine.runner, 8, 48, engine.config.max_model_len)


def test_capture_runs_without_garbage_collection_in_thread_local_mode(demo_dir, monkeypatch):
    """On the CPU, with torch's capture calls faked: the capture block runs with automatic
    garbage collection off and capture_error_mode "thread_local", and collection is back on
    after it (and stays off for a caller that had turned it off)."""
    seen: list[tuple[bool, str]] = []

    @contextmanager
    def fake_graph(graph: object, pool: object = None, stream: object = None,
                   capture_error_mode: str = "global") -> Iterator[None]:
        seen.append((gc.isenabled(), capture_error_mode))
        yield

    monkeypatch.setattr(torch.cuda, "graph", fake_graph)
    monkeypatch.setattr(torch.cuda, "CUDAGraph", object)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a: None)
    _, mixed = _mixed_graphs(demo_dir, "cpu")
    with torch.inference_mode():
        mixed.reset_buffers()
        mixed._capture(16, frozenset(), 0)
        assert seen == [(False, "thread_local")] and gc.isenabled()
        gc.disable()
        try:
            mixed._capture(32, frozenset(), 0)
            assert not gc.isenabled()
        finally:
            gc.enable()
    assert len(seen) == 2 and set(mixed.graphs) == {(16, frozenset(), 0), (32, frozenset(), 0)}


class _Cycle:
    """Garbage only the cyclic collector frees (as an engine whose runner.run a bench wrapped)."""

    def __init__(self, held: object) -> None:
        self.held = held
        self.me = self


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_graph_freed_by_the_collector_during_a_capture_does_not_break_it(demo_dir,
                                                                         monkeypatch):
    """A captured graph that becomes cyclic garbage inside the next capture, with the collector
    set to run at every allocation: before the fix its destruction (cudaGraphExecDestroy) in
    the capture invalidated it. The new graph must capture and replay."""
    engine, mixed = _mixed_graphs(demo_dir, "cuda")
    victim = torch.cuda.CUDAGraph()
    x = torch.zeros(4, device="cuda")
    with torch.cuda.graph(victim):
        x.add_(1)
    victim.replay()
    model = engine.runner.model
    forward = model.forward
    dropped = []

    def forward_dropping_the_victim(*args: Any, **kw: Any) -> torch.Tensor:
        if torch.cuda.is_current_stream_capturing() and not dropped:
            dropped.append(True)
            _Cycle(holder.pop())  # now only the cycle holds the graph
            for _ in range(100):  # allocations that would trigger a collection
                [[] for _ in range(10)]
        return forward(*args, **kw)

    holder = [victim]
    del victim
    monkeypatch.setattr(model, "forward", forward_dropping_the_victim)
    threshold = gc.get_threshold()
    gc.set_threshold(1)
    try:
        with torch.inference_mode():
            mixed.reset_buffers()
            mixed._capture(16, frozenset(), 0)
    finally:
        gc.set_threshold(*threshold)
    assert dropped
    gc.collect()  # the victim goes now, outside any capture
    mixed.graphs[(16, frozenset(), 0)].replay()
    torch.cuda.synchronize()
