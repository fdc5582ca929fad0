"""Sole-adapter ride (EngineConfig.ride_sole_adapter): unmerged steps whose every token reads
one adapter run it as the adapter's A rows appended to each projection's weight plus one
expand GEMM, against transformers + peft; every other step runs the kernels as before."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from slora_core.config import ConfigError, EngineConfig
from slora_core.engine import LLMEngine
from slora_core.lora import LoraLinear
from slora_core.lora_ride import RIDE_AFTER_STEPS, RIDE_ROW_ALIGN, SoleAdapterRide
from slora_core.sampling_params import SamplingParams
from tests.slora_core.test_engine import hf_greedy
from tests.slora_core.test_lora_merge import NEW_TOKENS, PROMPTS, _generate


def _engine(demo_dir: Path, names: list[str], dtype: str = "float32") -> LLMEngine:
    engine = LLMEngine.from_model_dir(
        demo_dir / "model", EngineConfig(ride_sole_adapter=True, merge_sole_adapter=False,
                                         dtype=dtype))
    for name in names:
        engine.register_adapter(name, demo_dir / "adapters" / name)
    return engine


def _ride(engine: LLMEngine) -> SoleAdapterRide:
    ride = engine.runner.ride
    assert ride is not None
    return ride


def test_one_adapter_rides_and_matches_peft(demo_dir):
    names = sorted(p.name for p in (demo_dir / "adapters").iterdir())
    engine = _engine(demo_dir, names[:2])
    ride = _ride(engine)
    loaded = [lin.base.weight.detach().clone() for lin in ride.layers]

    got = _generate(engine, [(p, names[0]) for p in PROMPTS])
    # Every decode step after the first few rode on one load.
    assert ride.loads == 1 and ride.ride_steps >= NEW_TOKENS - RIDE_AFTER_STEPS
    model_dir, adir = demo_dir / "model", demo_dir / "adapters" / names[0]
    for i, prompt in enumerate(PROMPTS):
        ref, _ = hf_greedy(model_dir, adir, prompt, NEW_TOKENS)
        assert got[str(i)] == ref, f"prompt {i}"
        # The adapter changes the continuation, so a ride that lost it would fail above.
        assert ref != hf_greedy(model_dir, None, prompt, NEW_TOKENS)[0], f"prompt {i}"
    # The base weights are untouched (the Linear's weight is the wide one's first rows).
    assert all(torch.equal(lin.base.weight, w0) for lin, w0 in
               zip(ride.layers, loaded, strict=True))
    assert ride.nbytes > 0

    # Another adapter alone: its rows replace the first's once it has held long enough.
    other = _generate(engine, [(PROMPTS[1], names[1])])
    assert ride.loads == 2
    assert other["0"] == hf_greedy(model_dir, demo_dir / "adapters" / names[1], PROMPTS[1],
                                   NEW_TOKENS)[0]
    # Two adapters in every step: the kernels, each matching peft; no load.
    steps = ride.ride_steps
    mixed = _generate(engine, [(PROMPTS[0], names[0]), (PROMPTS[1], names[1])])
    assert ride.ride_steps == steps and ride.loads == 2
    assert mixed["0"] == hf_greedy(model_dir, adir, PROMPTS[0], NEW_TOKENS)[0]
    # Base-model rows beside adapter rows: the kernels too.
    base_mix = _generate(engine, [(PROMPTS[0], names[0]), (PROMPTS[2], None)])
    assert ride.ride_steps == steps
    assert base_mix["1"] == hf_greedy(model_dir, None, PROMPTS[2], NEW_TOKENS)[0]


@pytest.mark.parametrize("dtype", ["float32", "float16"])
def test_a_ride_step_gives_the_kernel_path_logits(demo_dir, dtype):
    """The same decode steps through the ride and through the LoRA kernels' path (here their
    torch references), within the dtype's rounding: float32 to 1e-4, float16 to what peft's
    float16 forward gives against its float32 one on the same inputs."""
    names = sorted(p.name for p in (demo_dir / "adapters").iterdir())
    engine = _engine(demo_dir, names[:1], dtype=dtype)
    runner, ride = engine.runner, _ride(engine)
    run = runner.run
    diffs: list[float] = []

    def both(scheduled, patch=None):
        before = ride.ride_steps
        logits = run(scheduled, patch)
        if ride.loaded is not None and ride._streak[0] == ride.loaded:
            # This step rode (in float32 the two paths may agree to the bit: the same dot
            # products, whatever way the BLAS blocks them, so a difference proves nothing).
            assert ride.ride_steps == before + 1
            runner.ride = None  # the kernel path on the same step
            try:
                plain = run(scheduled, patch)
            finally:
                runner.ride = ride
            diffs.append(float((logits - plain).abs().max() / plain.abs().max()))
        return logits

    runner.run = both  # type: ignore[method-assign]
    _generate(engine, [(p, names[0]) for p in PROMPTS])
    assert len(diffs) >= NEW_TOKENS - RIDE_AFTER_STEPS - 1
    bound = 1e-4 if dtype == "float32" else 1e-2
    assert max(diffs) < bound, diffs


def test_padded_ride_decode_step_gives_the_unpadded_logits(demo_dir):
    """The decode graphs' ride key (ride_tiles) run eagerly on padded rows gives the logits of
    the unpadded ride step."""
    from slora_core.cuda_graphs import DecodeGraphs, is_ride, ride_tiles
    from slora_core.step_inputs import build_step_inputs

    names = sorted(p.name for p in (demo_dir / "adapters").iterdir())
    engine = _engine(demo_dir, names[:1])
    runner, ride = engine.runner, _ride(engine)
    graphs = DecodeGraphs(runner, 8, engine.config.max_model_len)
    assert ride_tiles(ride.rows) in graphs._tile_caps(8) and is_ride(ride_tiles(8))
    run = runner.run
    checked = []

    def both(scheduled, patch=None):
        logits = run(scheduled, patch)
        inputs = ride.route(build_step_inputs(scheduled, runner.arena.block_size))
        if inputs.ride and graphs.can_run(inputs):
            # all-r16's rows: 16 a module, not max_rank's 64.
            assert graphs.prepare(inputs)[2] == ride_tiles(16) and ride.rows == 16
            with torch.inference_mode():
                padded = graphs.run_padded_eager(inputs)
            torch.testing.assert_close(padded, logits, rtol=1e-5, atol=1e-5)
            checked.append(inputs.num_seqs)
        return logits

    runner.run = both  # type: ignore[method-assign]
    _generate(engine, [(p, names[0]) for p in PROMPTS])
    assert len(checked) >= NEW_TOKENS // 2 and any(n not in graphs.buckets for n in checked)


def test_ride_rows_follow_the_arena_slot(demo_dir):
    """A load copies the slot's A rows and scale * B^T into the wide weight and expand matrix,
    `rows` (the adapter's rank rounded up) a module; modules the adapter lacks and ranks
    below `rows` stay zero."""
    names = sorted(p.name for p in (demo_dir / "adapters").iterdir())
    engine = _engine(demo_dir, names[:1])
    ride = _ride(engine)
    _generate(engine, [(PROMPTS[0], names[0])])
    slot, _ = ride.loaded or (None, None)
    assert slot is not None
    t = engine.arena.tables
    ranks = t.ranks[:, slot]
    for lin in ride.layers:
        rr = lin.ride
        assert isinstance(lin, LoraLinear) and rr is not None
        k = lin.base.in_features
        for i, (m, (start, size)) in enumerate(zip(lin.module_ids, lin.out_slices,
                                                   strict=True)):
            r = int(ranks[lin.layer, m])
            rows = rr.weight[rr.out + i * rr.rows : rr.out + (i + 1) * rr.rows]
            block = rr.b_t[i * rr.rows : (i + 1) * rr.rows, start : start + size]
            assert not rows[r:].any() and not block[r:].any()
            if r:
                # The tables are [layers, slots, modules].
                a0 = int(t.a_offsets[lin.layer, slot, m])
                b0 = int(t.b_offsets[lin.layer, slot, m])
                a = t.arena[a0 : a0 + r * k].view(r, k)
                b = t.arena[b0 : b0 + size * r].view(size, r)
                assert torch.equal(rows[:r], a)
                scale = float(t.scales[lin.layer, slot, m])
                torch.testing.assert_close(block[:r], b.t() * scale)
            # Other modules' columns of these rows are zero: block-diagonal.
            others = torch.ones(rr.out, dtype=torch.bool)
            others[start : start + size] = False
            assert not rr.b_t[i * rr.rows : (i + 1) * rr.rows][:, others].any()
        # all-r16: 16 rows a module in use; the buffers' rows past them (up to max_rank's)
        # hold nothing.
        assert rr.rows == 16 and rr.rank == engine.config.max_rank == 64
        used = rr.modules * rr.rows
        assert not rr.weight[rr.out + used :].any() and not rr.b_t[used:].any()
    assert np.isfinite(float(ride.nbytes))


def test_ride_needs_one_device():
    with pytest.raises(ConfigError, match="ride_sole_adapter"):
        EngineConfig(ride_sole_adapter=True, tensor_parallel_size=2)


def test_padded_ride_mixed_step_gives_the_unpadded_logits(demo_dir):
    """Steps with prefill tokens ride too: the mixed graphs' ride key run eagerly on padded
    tokens gives the logits of the unpadded ride step (the later prompts' prefill chunks
    arrive while the first ones decode, all on the one adapter)."""
    from slora_core.cuda_graphs import MixedGraphs, ride_tiles
    from slora_core.step_inputs import build_step_inputs

    names = sorted(p.name for p in (demo_dir / "adapters").iterdir())
    engine = LLMEngine.from_model_dir(
        demo_dir / "model", EngineConfig(ride_sole_adapter=True, merge_sole_adapter=False,
                                         max_num_batched_tokens=16, max_num_seqs=4))
    engine.register_adapter(names[0], demo_dir / "adapters" / names[0])
    runner, ride = engine.runner, _ride(engine)
    mixed = MixedGraphs(runner, 4, 16, engine.config.max_model_len)
    run = runner.run
    checked = []

    def both(scheduled, patch=None):
        logits = run(scheduled, patch)
        inputs = ride.route(build_step_inputs(scheduled, runner.arena.block_size))
        if inputs.ride and inputs.max_query_len > 1:
            assert mixed.prepare(inputs)[2] == ride_tiles(ride.rows)
            with torch.inference_mode():
                padded = mixed.run_padded_eager(inputs)
            torch.testing.assert_close(padded, logits, rtol=1e-5, atol=1e-5)
            checked.append(int(inputs.input_ids.size))
        return logits

    runner.run = both  # type: ignore[method-assign]
    # Staggered long prompts: each arrives as chunks beside the others' decodes.
    prompts = [list(range(3, 40)), list(range(50, 75)), list(range(100, 130))]
    params = SamplingParams(temperature=0, max_new_tokens=NEW_TOKENS, ignore_eos=True)
    for i, prompt in enumerate(prompts):
        engine.add_request(str(i), prompt, params, adapter=names[0])
        for _ in range(6):
            engine.step()
    while engine.has_unfinished():
        engine.step()
    assert len(checked) >= 2


def test_fused_consumer_expands_give_the_addmm_logits(demo_dir, monkeypatch):
    """qkv's and gate_up's expands fused into rotary and silu_mul, and o's and down's as a
    Triton launch (triton_expands; the kernels on Triton's interpreter), give the logits of
    the same ride steps with every expand an addmm."""
    from slora_core import ops
    from slora_kernels import ride_expand, rotary, silu_mul

    monkeypatch.setattr(ops, "_use_triton", lambda t: True)
    calls = {"rotary": 0, "silu_mul": 0, "expand": 0}
    for mod, name, key in ((rotary, "rotary_expand_triton", "rotary"),
                           (silu_mul, "silu_mul_expand_triton", "silu_mul"),
                           (ride_expand, "expand_add_triton", "expand")):
        real = getattr(mod, name)

        def counted(*args, _real=real, _key=key, **kwargs):  # type: ignore[no-untyped-def]
            calls[_key] += 1
            return _real(*args, **kwargs)

        monkeypatch.setattr(mod, name, counted)
    names = sorted(p.name for p in (demo_dir / "adapters").iterdir())
    engine = _engine(demo_dir, names[:1])
    runner, ride = engine.runner, _ride(engine)
    assert ride.fused_consumers and ride.triton_expands  # the defaults
    run = runner.run
    diffs: list[float] = []

    def both(scheduled, patch=None):
        before = dict(calls)
        logits = run(scheduled, patch)
        if calls != before:  # this step rode, with the fused expands
            layers = engine.model_config.num_hidden_layers
            want = {"rotary": layers, "silu_mul": layers, "expand": 2 * layers}
            assert {k: calls[k] - before[k] for k in calls} == want
            ride.fused_consumers = ride.triton_expands = False
            try:
                plain = run(scheduled, patch)
            finally:
                ride.fused_consumers = ride.triton_expands = True
            # None the second time: every expand an addmm.
            assert calls == {k: before[k] + want[k] for k in calls}
            diffs.append(float((logits - plain).abs().max() / plain.abs().max()))
        return logits

    runner.run = both  # type: ignore[method-assign]
    # Few tokens: every op runs on the interpreter. The ride starts after RIDE_AFTER_STEPS.
    new_tokens = RIDE_AFTER_STEPS + 4
    engine.add_request("0", PROMPTS[0], SamplingParams(
        temperature=0, max_new_tokens=new_tokens, ignore_eos=True), adapter=names[0])
    while engine.has_unfinished():
        engine.step()
    assert len(diffs) >= new_tokens - RIDE_AFTER_STEPS - 1
    assert max(diffs) < 1e-4, diffs


def test_a_deferred_expand_nobody_takes_fails_the_step():
    from slora_core.context import PendingExpand, defer_expand, step_context, take_expand

    out = torch.zeros(4, 8)
    pending = PendingExpand(out, torch.ones(4, 2), torch.ones(2, 8), 2)
    with pytest.raises(RuntimeError, match="never taken"), step_context(None):  # type: ignore[arg-type]
        defer_expand(pending)
    # Taken: the step ends cleanly, and a view of other rows or another stride is not it.
    with step_context(None):  # type: ignore[arg-type]
        defer_expand(pending)
        assert take_expand(out[1:]) is None and take_expand(out.t()) is None
        assert take_expand(out) is pending and take_expand(out) is None


def test_bench_ride_modes_switch_launches_and_keep_each_modes_graphs(demo_dir):
    """bench.distinct_adapters' --ride-variants: RideModes sets the ride's launches per arm and
    keeps each mode's captured ride graphs apart (take/put); other graphs stay put."""
    from bench.distinct_adapters import RIDE_VARIANTS, RideModes, parse_ride_variants
    from slora_core.cuda_graphs import DecodeGraphs, ride_tiles

    names = sorted(p.name for p in (demo_dir / "adapters").iterdir())
    engine = _engine(demo_dir, names[:1])
    ride = _ride(engine)
    graphs = engine.runner.graphs = DecodeGraphs(engine.runner, 8,
                                                 engine.config.max_model_len)
    ride_key, tile_key = (8, frozenset({0}), ride_tiles(16)), (8, frozenset({0}), 4)
    wide_key = (8, frozenset({0}), ride_tiles(64))  # another row count's: taken alike
    for key in (ride_key, tile_key, wide_key):  # stand-ins for graphs, told apart by identity
        graphs.graphs[key], graphs.logits[key], graphs.contexts[key] = (
            object(), torch.zeros(1), object())
    fused_graph, tile_graph = graphs.graphs[ride_key], graphs.graphs[tile_key]
    wide_graph = graphs.graphs[wide_key]
    modes = RideModes(engine, ride)
    assert modes.default == (True, True, True, 16)

    modes.set(RIDE_VARIANTS["addmm"])
    assert (ride.fused_consumers, ride.triton_expands) == (False, False)
    assert ride_key not in graphs.graphs and graphs.graphs[tile_key] is tile_graph
    assert wide_key not in graphs.graphs
    addmm_graph = graphs.graphs[ride_key] = object()  # captured in the addmm mode
    graphs.logits[ride_key], graphs.contexts[ride_key] = torch.zeros(1), object()

    modes.set(RIDE_VARIANTS["nopdl"])
    assert ride.fused_consumers and not ride.triton_expands
    assert ride_key not in graphs.graphs
    modes.set(RIDE_VARIANTS["addmm"])
    assert graphs.graphs[ride_key] is addmm_graph
    # maxrows: the rows' layout changes, so the next ride step loads them again.
    ride.loaded = (0, 0)
    modes.set(RIDE_VARIANTS["maxrows"])
    assert not ride.rank_sized and ride.loaded is None and ride.rows_for(8) == 64
    modes.set(RIDE_VARIANTS["unaligned"])  # the outputs' row stride unpadded
    assert ride.row_align == 1 and ride.rank_sized and ride_key not in graphs.graphs
    modes.set(modes.default)
    assert graphs.graphs[ride_key] is fused_graph and graphs.graphs[tile_key] is tile_graph
    assert graphs.graphs[wide_key] is wide_graph and ride.rank_sized and ride.rows_for(8) == 8
    assert (ride.fused_consumers, ride.triton_expands, ride.rank_sized, ride.row_align) == (
        True, True, True, 16)

    assert parse_ride_variants("addmm, triton") == ("addmm", "triton")
    assert parse_ride_variants("") == ()
    with pytest.raises(Exception, match="unknown ride variants fused2"):
        parse_ride_variants("addmm,fused2")


def test_ride_rows_sized_to_the_adapter_rank_give_the_max_rank_rows_logits(demo_dir):
    """Rows a module sized to the loaded adapter's rank (powers of two from 8, up to
    max_rank) or at max_rank (rank_sized off): the same decode steps give the same logits
    (the extra rows are zeros), and the GEMMs read fewer rows."""
    names = sorted(p.name for p in (demo_dir / "adapters").iterdir())
    engine = _engine(demo_dir, ["attn-r12"])
    runner, ride = engine.runner, _ride(engine)
    assert [ride.rows_for(r) for r in (1, 4, 8, 9, 12, 16, 17, 40, 64)] == [
        8, 8, 8, 16, 16, 16, 32, 64, 64]
    assert "attn-r12" in names
    run = runner.run
    diffs: list[float] = []
    rows_seen: set[tuple[int, int]] = set()

    def both(scheduled, patch=None):
        # Back to rank-sized rows; after a max_rank step the rows are laid out for 64: reload.
        ride.rank_sized = True
        if ride.rows != 16:
            ride.loaded = None
        logits = run(scheduled, patch)
        if ride.loaded is not None and ride._streak[0] == ride.loaded:
            sized = ride.rows
            ride.rank_sized, ride.loaded = False, None  # loads again, at max_rank's rows
            wide = run(scheduled, patch)
            rows_seen.add((sized, ride.rows))
            diffs.append(float((logits - wide).abs().max() / wide.abs().max()))
        return logits

    runner.run = both  # type: ignore[method-assign]
    _generate(engine, [(p, "attn-r12") for p in PROMPTS])
    assert rows_seen == {(16, 64)} and len(diffs) >= NEW_TOKENS - RIDE_AFTER_STEPS - 1
    assert max(diffs) < 1e-5, diffs


def test_start_up_queues_a_ride_graph_for_every_row_count(demo_dir, monkeypatch):
    """Every row count a load can choose has its ride graphs in the warm-up queue (so no
    rank's first ride compiles or captures mid-serving), and a ride key's dry run (what
    slora_core.precompile runs) reads its own row count, not the loaded adapter's, which it
    leaves as it was."""
    from slora_core.cuda_graphs import DecodeGraphs, MixedGraphs, ride_tiles
    from slora_core.lora import RideRows

    engine = _engine(demo_dir, ["all-r16"])
    runner, ride = engine.runner, _ride(engine)
    assert ride.row_counts == (8, 16, 32, 64)
    decode = DecodeGraphs(runner, 8, engine.config.max_model_len)
    mixed = MixedGraphs(runner, 4, 16, engine.config.max_model_len)
    for graphs, bucket in ((decode, 8), (mixed, 16)):
        assert {ride_tiles(r) for r in (8, 16, 32, 64)} <= set(graphs._tile_caps(bucket))
    _generate(engine, [(PROMPTS[0], "all-r16")])
    assert ride.rows == 16
    seen: list[int] = []
    real = RideRows.forward

    def recorded(self, x, bias):  # type: ignore[no-untyped-def]
        seen.append(self.rows)
        return real(self, x, bias)

    monkeypatch.setattr(RideRows, "forward", recorded)
    key = (8, engine.arena.active_lora_modules, ride_tiles(64))
    decode.dry_forward(key)
    assert seen and set(seen) == {64} and ride.rows == 16
    ride.rank_sized = False
    assert ride.row_counts == (64,)


def test_ride_outputs_row_stride_padded_to_the_alignment_gives_the_unpadded_logits(demo_dir):
    """The wide GEMM's output is padded with zero columns to a row stride that is a multiple
    of RIDE_ROW_ALIGN (rank-8 rows leave qkv's and o's widths off it); the same steps with the
    padding off (row_align 1) give the same logits, and a row_align the weights were not
    allocated for is refused."""
    engine = _engine(demo_dir, ["attn-r8"])
    runner, ride = engine.runner, _ride(engine)
    assert ride.row_align == RIDE_ROW_ALIGN == 16
    run = runner.run
    diffs: list[float] = []
    strides: set[tuple[int, int]] = set()

    def both(scheduled, patch=None):
        ride.row_align = RIDE_ROW_ALIGN
        logits = run(scheduled, patch)
        if ride.loaded is not None and ride._streak[0] == ride.loaded:
            for lin in ride.layers:
                rr = lin.ride
                assert rr is not None and rr.width() % RIDE_ROW_ALIGN == 0
                strides.add((rr.out + rr.modules * rr.rows, rr.width()))
            ride.row_align = 1
            unpadded = run(scheduled, patch)
            diffs.append(float((logits - unpadded).abs().max() / unpadded.abs().max()))
        return logits

    runner.run = both  # type: ignore[method-assign]
    _generate(engine, [(p, "attn-r8") for p in PROMPTS])
    assert ride.rows == 8 and diffs and max(diffs) < 1e-5, diffs
    # Some projection's unpadded width is off the alignment (so the padding was exercised).
    assert any(used % RIDE_ROW_ALIGN for used, _ in strides), strides
    ride.row_align = RIDE_ROW_ALIGN
    with pytest.raises(ValueError, match="allocated for"):
        ride.row_align = 128  # o's and gate_up's weights could take it, qkv's not
    with pytest.raises(ValueError, match="1 or more"):
        ride.row_align = 0
    # A refused alignment changes no projection.
    assert {lin.ride.align for lin in ride.layers if lin.ride} == {RIDE_ROW_ALIGN}
