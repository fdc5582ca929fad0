"""Issue 15 (an illegal memory access under adapter churn): the step index checks
(SLORA_CHECK_INDICES) hold through a churn workload on the CPU, catch broken steps, and CUDA-graph
captures after steps have run no longer read the last step's inputs."""

from __future__ import annotations

import json
import os
import random
from pathlib import Path

import pytest
import torch

from slora_core import step_checks
from slora_core.config import EngineConfig
from slora_core.cuda_graphs import ROW_GRAPH, DecodeGraphs, MixedGraphs
from slora_core.engine import LLMEngine
from slora_core.sampling_params import SamplingParams
from slora_core.step_checks import StepIndexError, check_context, check_scheduled
from slora_core.step_inputs import build_step_inputs


@pytest.fixture
def checks_on(monkeypatch):
    monkeypatch.setattr(step_checks, "ENABLED", True)


def _adapter_dirs(demo_dir: Path) -> list[Path]:
    return sorted((demo_dir / "adapters").iterdir())


def _own_copy(src: Path, root: Path, name: str) -> Path:
    """`src`'s weights under a config of `name`'s own (its `revision`): distinct content, so a
    distinct adapter (the engine knows adapters by content digest, not by name)."""
    path = root / name
    if not path.exists():
        path.mkdir(parents=True)
        config = json.loads((src / "adapter_config.json").read_text())
        (path / "adapter_config.json").write_text(json.dumps({**config, "revision": name}))
        (path / "adapter_model.safetensors").symlink_to(src / "adapter_model.safetensors")
    return path


def _churn_engine(demo_dir: Path, num_names: int, **kw) -> LLMEngine:
    """The demo model with `num_names` distinct adapters registered as files (their weights
    cycle over the demo adapters'), none preloaded."""
    engine = LLMEngine.from_model_dir(demo_dir / "model", EngineConfig(**kw))
    dirs = _adapter_dirs(demo_dir)
    for i in range(num_names):
        # Beside demo_dir, not in it: the demo assets are shared read-only (tests/conftest.py).
        own = _own_copy(dirs[i % len(dirs)], demo_dir.parent / f"distinct-adapters-{os.getpid()}",
                        f"a{i}")
        engine.register_adapter(f"a{i}", own, preload=False)
    return engine


def _churn(engine: LLMEngine, num_requests: int, num_names: int, seed: int
           ) -> dict[str, list[int]]:
    """Requests arriving over time on Zipf-ish adapters (some base), one abort half-way."""
    rng = random.Random(seed)
    vocab = engine.model_config.vocab_size
    pending = []
    for i in range(num_requests):
        prompt = [rng.randrange(3, vocab) for _ in range(rng.choice((3, 30, 50, 60, 62)))]
        k = int(num_names * rng.random() ** 2)  # low names more popular
        adapter = None if rng.random() < 0.15 else f"a{k}"
        params = SamplingParams(temperature=0, max_new_tokens=rng.randrange(1, 24),
                                ignore_eos=True)
        pending.append((str(i), prompt, params, adapter))
    tokens: dict[str, list[int]] = {}
    steps = 0
    while pending or engine.has_unfinished():
        for _ in range(rng.randrange(0, 6)):
            if pending:
                rid, prompt, params, adapter = pending.pop(0)
                engine.add_request(rid, prompt, params, adapter=adapter)
        if steps == 20:
            engine.abort_request("5")
        for out in engine.step():
            tokens.setdefault(out.request_id, []).extend(out.token_ids)
        steps += 1
    return tokens


def test_churn_keeps_every_step_index_in_range_and_owned(demo_dir, checks_on):
    """Tiny arena (adapters evicted, sequences preempted), a host tier that keeps one adapter
    (reloads from disk), adapters loaded and evicted every few steps: every step passes the
    ownership and index checks, the tokens equal a roomy engine's, all pages come back."""
    names, n = 24, 40
    tight = _churn_engine(demo_dir, names, num_pages=20, block_size=64, max_num_seqs=8,
                          max_num_batched_tokens=48, max_adapters_per_batch=3,
                          host_cache_bytes=1)
    got = _churn(tight, n, names, seed=1)
    st = tight.stats
    assert st.adapter_evictions > 10 and st.preemptions > 0 and st.adapter_disk_loads > 10
    assert tight.pool.num_kv_pages == 0
    roomy = _churn_engine(demo_dir, names, num_pages=512, block_size=64, max_num_seqs=8,
                          max_num_batched_tokens=48, max_adapters_per_batch=3)
    want = _churn(roomy, n, names, seed=1)
    assert roomy.stats.preemptions == 0
    got.pop("5", None), want.pop("5", None)  # aborted at a step count, not a token count
    assert got == want and len(got) == n - 1


def test_checks_catch_a_page_owned_twice_and_a_foreign_slot(demo_dir, checks_on):
    engine = _churn_engine(demo_dir, 2, num_pages=64, block_size=64)
    for name in ("a0", "a1"):  # in the host tier, so the requests are schedulable at once
        engine.load_adapter(name)
    params = SamplingParams(temperature=0, max_new_tokens=4, ignore_eos=True)
    engine.add_request("x", [5, 6, 7], params, adapter="a0")
    engine.add_request("y", [8, 9], params, adapter="a1")
    sched = engine.scheduler.schedule()
    engine._apply_memory_changes(sched)
    check_scheduled(sched.scheduled, engine.pool, engine.arena)  # a sane step passes
    x, y = (s.seq for s in sched.scheduled)
    x.block_table[0], saved = y.block_table[0], x.block_table[0]
    with pytest.raises(StepIndexError, match="page"):
        check_scheduled(sched.scheduled, engine.pool, engine.arena)
    x.block_table[0] = saved
    # Slot of a0 pointed at a1's pages (what a table row of an evicted adapter would read).
    s0, s1 = (engine.pool.resident(engine.adapters.digest_of(k)).slot for k in ("a0", "a1"))
    tables = engine.arena.tables
    tables.a_offsets[:, s0] = tables.a_offsets[:, s1]
    tables.ranks[:, s0] = tables.ranks[:, s1]
    with pytest.raises(StepIndexError, match="does not own"):
        check_scheduled(sched.scheduled, engine.pool, engine.arena)


def _first_big_step(engine: LLMEngine):
    """Drive the engine until a step with prefill tokens and adapters; its StepInputs."""
    run = engine.runner.run
    seen = []

    def spy(scheduled, patch=None):
        inputs = build_step_inputs(scheduled, engine.arena.block_size)
        if inputs.max_query_len > 1 and inputs.has_lora and not seen:
            seen.append(inputs)
        return run(scheduled, patch)

    engine.runner.run = spy  # type: ignore[method-assign]
    params = SamplingParams(temperature=0, max_new_tokens=3, ignore_eos=True)
    for i in range(6):
        engine.add_request(str(i), list(range(10, 10 + 7 * (i + 1))), params,
                           adapter=f"a{i % 3}" if i % 2 == 0 else None)
    while engine.has_unfinished():
        engine.step()
    engine.runner.run = run  # type: ignore[method-assign]
    return seen[0]


@pytest.mark.parametrize("kind", ["mixed", "decode"])
def test_capture_after_steps_reads_no_stale_step_inputs(demo_dir, kind):
    """Issue 15's crash: warmup() after steps had run (bench.churn's disk engine, coldttft)
    captured graphs whose warm-up forwards read the last step's query starts, logits rows and
    LoRA tiles, past a smaller bucket's rows. Each queued capture now starts from inert
    buffers; the stale ones fail the checks."""
    engine = _churn_engine(demo_dir, 3, num_pages=256, block_size=64, max_num_seqs=8,
                           max_num_batched_tokens=160)
    runner = engine.runner
    # Adapters in the host tier first: otherwise a slow adapter read (a loaded CI machine) can
    # leave the first LoRA step with prompt tokens a small one, whose inputs fit the smallest
    # bucket and leave nothing stale to catch.
    for name in ("a0", "a1", "a2"):
        engine.load_adapter(name)
    big = _first_big_step(engine)
    assert big.num_tokens > 32, big.num_tokens
    graphs = (MixedGraphs(runner, 8, 160, engine.config.max_model_len) if kind == "mixed"
              else DecodeGraphs(runner, 8, engine.config.max_model_len))
    if kind == "mixed":
        graphs.prepare(big)
    else:  # a decode step of 7 rows on three adapters: the last step the buffers saw
        big = _decode_step(engine, 7)
        graphs.prepare(big)
    modules = runner.arena.active_lora_modules or frozenset({0})
    small = graphs.buckets[0]
    # The shortest tile list (the row kernels' graph reads no tile list: not this check's).
    tiles = [cap for cap in graphs._tile_caps(small) if cap != ROW_GRAPH][-1]
    with pytest.raises(StepIndexError):
        check_context(graphs._context(small, modules, tiles), small, runner.arena)

    checked = []

    def fake_capture(bucket, mods, tiles):  # what _capture runs before the CUDA capture
        ctx = graphs._context(bucket, mods, tiles)
        check_context(ctx, bucket, runner.arena)
        with torch.inference_mode():
            graphs._forward(bucket, ctx)
        checked.append(bucket)

    graphs._capture = fake_capture  # type: ignore[method-assign]
    for key in graphs.defer(modules):
        graphs.capture_deferred(key)
    assert small in checked and len(checked) >= len(graphs.buckets)


def _decode_step(engine: LLMEngine, rows: int):
    """StepInputs of a decode step of `rows` sequences on three adapters."""
    params = SamplingParams(temperature=0, max_new_tokens=50, ignore_eos=True)
    for i in range(rows):
        engine.add_request(f"d{i}", [3 + i, 4, 5], params, adapter=f"a{i % 3}")
    engine.step()  # prefill
    sched = engine.scheduler.schedule()
    engine._apply_memory_changes(sched)
    inputs = build_step_inputs(sched.scheduled, engine.arena.block_size)
    assert inputs.max_query_len == 1 and inputs.num_seqs == rows and inputs.has_lora
    return inputs


def test_row_kernel_steps_check_each_token_slot(demo_dir):
    """The row kernels read every token's adapter slot (no tile list): a decode graph's
    row-kernel context is checked through its token slots, which must name a slot whose table
    rows point inside the arena."""
    engine = _churn_engine(demo_dir, 3, num_pages=256, block_size=64, max_num_seqs=8,
                           max_num_batched_tokens=160, lora_row_kernels=True)
    for name in ("a0", "a1", "a2"):  # in the host tier, so the prefill runs in one step
        engine.load_adapter(name)
    runner = engine.runner
    graphs = DecodeGraphs(runner, 8, engine.config.max_model_len)
    key = graphs.prepare(_decode_step(engine, 6))
    assert key[2] == ROW_GRAPH  # three adapters on six rows: two rows each
    ctx = graphs._context(*key)
    check_context(ctx, key[0], runner.arena)
    slots = graphs.buf.token_slots
    saved = slots.clone()
    slots[3] = runner.arena.num_slots
    with pytest.raises(StepIndexError, match="token_slots"):
        check_context(ctx, key[0], runner.arena)
    slots.copy_(saved)
    # A token's slot whose A matrix lies past the arena (what a stale table row would read).
    slot = int(saved[0])
    tables = runner.arena.tables
    live = tables.ranks[:, slot] > 0
    tables.a_offsets[:, slot][live] = runner.arena.num_pages * runner.arena.page_numel
    with pytest.raises(StepIndexError, match="offsets"):
        check_context(ctx, key[0], runner.arena)
