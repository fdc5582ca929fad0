"""Graphs captured while serving, on the CPU: with every graph queued (warmup(background=True))
steps run the padded step eagerly and give the tokens of an engine without graphs; the queue is
taken one graph at a time, largest bucket first, each timed as a background `graph_capture`
record. torch's capture calls are faked on the CPU (as tests/slora_core/test_graph_capture.py
does); the H200 run (bench/worker_startup.py) captures for real."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
import torch

from services.worker.startup import BackgroundGraphs, warm_up
from slora_core.compile_cache import CacheKey, CompileCache
from slora_core.config import EngineConfig
from slora_core.cuda_graphs import DecodeGraphs, MixedGraphs
from slora_core.engine import LLMEngine
from slora_core.sampling_params import SamplingParams
from slora_core.startup_profile import StartupProfile

SEQS, TOKENS = 4, 32


def engine_with_graphs(demo_dir: Path, graphs: bool) -> LLMEngine:
    """A CPU engine with the adapters registered; with `graphs`, decode and mixed-step graph
    sets attached as a CUDA engine builds them (nothing captured)."""
    engine = LLMEngine.from_model_dir(demo_dir / "model", EngineConfig(
        max_num_seqs=SEQS, max_num_batched_tokens=TOKENS, cuda_graphs=False))
    for adapter in sorted(p.name for p in (demo_dir / "adapters").iterdir()):
        engine.register_adapter(adapter, demo_dir / "adapters" / adapter)
    if graphs:
        runner = engine.runner
        runner.graphs = DecodeGraphs(runner, SEQS, engine.max_model_len)
        runner.mixed = MixedGraphs(runner, SEQS, TOKENS, engine.max_model_len, runner.graphs)
    return engine


def serve(engine: LLMEngine, demo_dir: Path,
          between: Callable[[], object] = lambda: None) -> dict[str, list[int]]:
    """Greedy tokens of a batch mixing the base model and adapters, prefill and decode;
    `between` runs after every step."""
    adapters = [None, *sorted(p.name for p in (demo_dir / "adapters").iterdir())][:SEQS]
    params = SamplingParams(temperature=0, max_new_tokens=3, ignore_eos=True)
    for i, adapter in enumerate(adapters):
        engine.add_request(f"r{i}", [3 + i, 9, 27, 81 % 500, 5 + 2 * i][: 3 + i], params,
                           adapter=adapter)
    tokens: dict[str, list[int]] = {}
    while engine.has_unfinished():
        for out in engine.step():
            tokens.setdefault(out.request_id, []).extend(out.token_ids)
        between()
    return tokens


def test_queued_graphs_serve_eagerly_with_the_same_tokens(demo_dir: Path) -> None:
    expected = serve(engine_with_graphs(demo_dir, graphs=False), demo_dir)
    engine = engine_with_graphs(demo_dir, graphs=True)
    engine.warmup(True, background=True)
    decode, mixed = engine.runner.graphs, engine.runner.mixed
    assert decode is not None and mixed is not None
    queued = engine.graphs_pending()
    # Base and LoRA graphs of every bucket the limits allow, and no other.
    assert queued == len(decode.deferred) + len(mixed.deferred) > 0
    assert {k[0] for k in decode.deferred} == set(decode.buckets) == {1, 2, 4}
    assert {k[0] for k in mixed.deferred} == set(mixed.buckets) == {16, 32}
    assert serve(engine, demo_dir) == expected
    # Served without capturing on the spot: the queue is untouched.
    assert not decode.graphs and not mixed.graphs and engine.graphs_pending() == queued


@contextmanager
def fake_capture(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """torch.cuda's capture calls as no-ops: the CPU runs the captured forward eagerly."""

    @contextmanager
    def graph(*_args: object, **_kwargs: object) -> Iterator[None]:
        yield

    monkeypatch.setattr(torch.cuda, "graph", graph)
    monkeypatch.setattr(torch.cuda, "CUDAGraph", object)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a: None)
    yield


@pytest.mark.slow
def test_queue_is_captured_one_graph_at_a_time(demo_dir: Path,
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    engine = engine_with_graphs(demo_dir, graphs=True)
    engine.warmup(True, background=True)
    queued = engine.graphs_pending()
    graphs = BackgroundGraphs.of(engine, stats=None)
    assert graphs is not None and graphs.pending == queued
    records = []
    with fake_capture(monkeypatch):
        while graphs.pending:
            records.append(graphs.capture_next())
            assert graphs.pending == queued - len(records)
    assert engine.capture_next_graph() is None and BackgroundGraphs.of(engine, None) is None
    assert all(r.name == "graph_capture" and r.background and r.seconds > 0 for r in records)
    labels = [(r.graphs, r.bucket) for r in records]
    # Base graphs first, then LoRA (decode then mixed-step graphs each), each set largest
    # bucket first (its pool serves the smaller ones); LoRA decode graphs once per tile list,
    # then the row kernels' graph. At these buckets (4 rows at most) every step the tile
    # kernels take fits one tile (the row kernels take adapters of up to
    # ROW_KERNELS_MAX_ROWS_PER_ADAPTER rows: cuda_graphs.tile_steps_max_tiles), so one list.
    assert labels[:5] == [("decode", 4), ("decode", 2), ("decode", 1), ("mixed", 32),
                          ("mixed", 16)]
    assert labels[5:11] == [("decode+lora:1", 4), ("decode+lora:rows", 4),
                            ("decode+lora:1", 2), ("decode+lora:rows", 2),
                            ("decode+lora:1", 1), ("decode+lora:rows", 1)]
    # Mixed-step tile lists of 16-row tiles (lora_meta.tile_rows): cdiv(bucket, 16) + 4 seqs.
    assert labels[-2:] == [("mixed+lora:6", 32), ("mixed+lora:5", 16)]
    assert len(set(labels)) == len(labels) == queued
    decode, mixed = engine.runner.graphs, engine.runner.mixed
    assert decode is not None and mixed is not None
    assert len(decode.graphs) + len(mixed.graphs) == queued


@pytest.mark.slow
def test_a_warmup_the_cache_holds_skips_the_precompile(demo_dir: Path, tmp_path: Path,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """The first start of a digest precompiles, captures and notes it; the next start of the
    same digest captures every graph without the precompile, another digest precompiles."""
    key = CacheKey(device="cpu", driver="", cuda="", triton="t", torch="t", python="p",
                   kernels="k" * 64)
    from services.worker import startup

    # The fake captures replay nothing, so the start's one real request is not served here.
    monkeypatch.setattr(startup, "warmup_request", lambda engine, vocab: 0.0)
    starts = []
    with fake_capture(monkeypatch):
        for digest in ("d1", "d1", "d2"):
            engine = engine_with_graphs(demo_dir, graphs=True)
            profile = StartupProfile()
            warm_up(engine, profile, 512, cache=CompileCache.open(tmp_path, key=key),
                    digest=digest)
            assert engine.graphs_pending() == 0
            starts.append([r.name for r in profile.records])
    assert [names.count("precompile") for names in starts] == [1, 0, 1]
    assert all(names.count("graph_capture") == starts[0].count("graph_capture") > 0
               for names in starts)
    assert CompileCache.open(tmp_path, key=key).holds("d2")


def test_a_failed_capture_leaves_the_rest_eager(demo_dir: Path,
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    """The engine-core loop's capture raises (as an out-of-memory capture would): the core
    tells the front how many graphs are left, tries no other, and serves on eagerly."""
    import zmq

    from services.worker import core_protocol as m
    from services.worker.engine_core import EngineCore

    expected = serve(engine_with_graphs(demo_dir, graphs=False), demo_dir)
    engine = engine_with_graphs(demo_dir, graphs=True)
    engine.warmup(True, background=True)
    queued = engine.graphs_pending()
    graphs = BackgroundGraphs.of(engine, stats=None)
    assert graphs is not None

    def broken(*_args: object, **_kwargs: object) -> None:
        raise RuntimeError("CUDA out of memory (test)")

    monkeypatch.setattr(torch.cuda, "graph", broken)
    monkeypatch.setattr(torch.cuda, "CUDAGraph", object)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a: None)
    ctx = zmq.Context()
    pull, push = ctx.socket(zmq.PULL), ctx.socket(zmq.PUSH)
    pull.bind("inproc://startup-test")
    push.connect("inproc://startup-test")
    try:
        EngineCore(engine, push, parent_pid=0, graphs=graphs)._capture_graph()
        update = m.from_core_decoder.decode(pull.recv())
    finally:
        push.close(linger=0)
        pull.close(linger=0)
        ctx.term()
    assert isinstance(update, m.StartupUpdate)
    assert update.records == [] and update.graphs_pending == queued
    assert graphs.failed and graphs.pending == 0  # the loop stops capturing
    assert serve(engine, demo_dir) == expected


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_graphs_captured_while_serving_on_the_gpu(demo_dir: Path) -> None:
    """On a GPU (asynchronous steps): an engine that serves while its graphs are queued, then
    captures them one between each two steps of a running batch, then replays them, gives the
    tokens of an engine whose graphs were all captured first."""

    def cuda_engine() -> LLMEngine:
        engine = LLMEngine.from_model_dir(demo_dir / "model", EngineConfig(
            device="cuda", max_num_seqs=SEQS, max_num_batched_tokens=TOKENS))
        for adapter in sorted(p.name for p in (demo_dir / "adapters").iterdir()):
            engine.register_adapter(adapter, demo_dir / "adapters" / adapter)
        return engine

    first = cuda_engine()
    first.warmup(True)
    expected = serve(first, demo_dir)
    later = cuda_engine()
    later.warmup(True, background=True)
    queued = later.graphs_pending()
    assert queued > 0
    assert serve(later, demo_dir) == expected  # every step eager
    captured = []
    while later.graphs_pending():
        assert serve(later, demo_dir, lambda: captured.append(later.capture_next_graph())) \
            == expected
    assert len([c for c in captured if c is not None]) == queued
    assert serve(later, demo_dir) == expected  # every step a replay
