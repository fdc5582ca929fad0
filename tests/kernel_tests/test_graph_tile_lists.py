"""Decode graphs' LoRA tile lists: every step's real tiles fit the captured list the step's key
picks (the full one, the short one of a bucket whose rows share one adapter, or from 64 rows on
the middle one), and the Triton kernels on that padded list give the reference delta for the
step's real segments."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import pytest
import torch

from slora_core.config import EngineConfig
from slora_core.cuda_graphs import (
    ROW_GRAPH,
    DecodeGraphs,
    decode_split_tiles,
    decode_tile_caps,
)
from slora_core.engine import LLMEngine
from slora_core.sampling_params import SamplingParams
from slora_core.step_inputs import build_step_inputs
from slora_kernels.lora import add_lora_triton
from slora_kernels.lora_meta import DECODE_BLOCK_M, ROW_BLOCK_M
from slora_kernels.lora_reference import add_lora_reference
from tests.kernel_tests.helpers import rel_err

QKV = (0, 1, 2)


@pytest.mark.parametrize("row_kernels", [True, False])
def test_decode_graph_tile_lists(demo_dir: Path, row_kernels: bool) -> None:
    """With `lora_row_kernels`, steps of at most two rows an adapter replay the row kernels'
    graph (block_m 1); the short, middle and full tile lists serve the rest."""
    names = sorted(p.name for p in (demo_dir / "adapters").iterdir())[:3]
    # On a GPU machine the kernels run compiled on CUDA; on the CPU in Triton's interpreter.
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    engine = LLMEngine.from_model_dir(
        demo_dir / "model",
        EngineConfig(max_num_seqs=64, device=dev, lora_row_kernels=row_kernels))
    for name in names:
        engine.register_adapter(name, demo_dir / "adapters" / name)
    runner = engine.runner
    graphs = DecodeGraphs(runner, 64, engine.config.max_model_len)
    tables = runner.arena.tables
    hidden = engine.model_config.hidden_size
    slices = ((0, hidden), (hidden, 16), (hidden + 16, 16))
    seen: list[tuple[int, int]] = []
    nonzero: list[bool] = []
    run = runner.run

    def check(scheduled, patch=None):  # type: ignore[no-untyped-def]
        inputs = build_step_inputs(scheduled, runner.arena.block_size)
        if graphs.can_run(inputs) and inputs.has_lora:
            bucket, _, tiles = key = graphs.prepare(inputs)
            meta = graphs._context(*key).lora
            rows = tiles == ROW_GRAPH
            cap = bucket if rows else tiles
            assert meta is not None and meta.num_tiles == cap
            assert meta.block_m == (ROW_BLOCK_M if rows else DECODE_BLOCK_M)
            assert meta.split_tiles == (None if rows else decode_split_tiles(
                bucket, tiles, 2 if row_kernels else None))
            real = inputs.lora_tiles(16)[0].size
            assert real <= cap and int((meta.tile_segs >= 0).sum()) == real
            seen.append((bucket, tiles))
            x = torch.randn(bucket, hidden, device=dev)
            y = torch.zeros(bucket, hidden + 32, device=dev)
            y_ref = y.double().cpu()
            args = (tables.arena, tables.a_offsets[0], tables.b_offsets[0], tables.ranks[0],
                    tables.scales[0], QKV, slices)
            add_lora_triton(y, x, *args, meta, max_rank=64)
            n = inputs.num_seqs
            ref_meta = type(meta).from_token_slots(inputs.token_slots.tolist(), block_m=16)
            add_lora_reference(y_ref[:n], x[:n].double().cpu(), tables.arena.double().cpu(),
                               *(t.cpu() for t in args[1:5]), *args[5:], ref_meta)
            assert rel_err(y.cpu(), y_ref) < 1e-5
            nonzero.append(bool(y_ref.abs().sum() > 0))
        return run(scheduled, patch)

    runner.run = check  # type: ignore[method-assign]
    params = SamplingParams(temperature=0, max_new_tokens=3, ignore_eos=True)
    for i in range(33):  # one adapter on 33 rows (bucket 48: 3 tiles fit the short list)
        engine.add_request(f"one{i}", [5 + i, 6, 7], params, adapter=names[0])
    while engine.has_unfinished():
        engine.step()
    for i in range(20):  # three adapters interleaved, ~7 rows each: the longest list
        engine.add_request(f"mix{i}", [9, 10 + i], params, adapter=names[i % 3])
    while engine.has_unfinished():
        engine.step()
    for i in range(3):  # a row each: the row kernels' graph, when on
        engine.add_request(f"row{i}", [11, 12 + i], params, adapter=names[i])
    while engine.has_unfinished():
        engine.step()
    # Three adapters on 20 rows each (bucket 64): 6 real tiles, past the short list's 4, fit
    # the middle list's 16; with the middle list off, the longest one (one a row, or with the
    # row kernels the most a tile step can take: 33).
    for use_mid in (True, False):
        graphs.use_mid_tiles = use_mid
        for i in range(60):
            engine.add_request(f"mid{use_mid}{i}", [13, 14 + i], params, adapter=names[i % 3])
        while engine.has_unfinished():
            engine.step()
    longest = {b: decode_tile_caps(b, 2 if row_kernels else None)[0] for b in (24, 64)}
    assert longest == ({24: 11, 64: 33} if row_kernels else {24: 24, 64: 64})
    assert (48, 3) in seen and (24, longest[24]) in seen
    assert (64, 16) in seen and (64, longest[64]) in seen
    assert any(tiles == ROW_GRAPH for _, tiles in seen) == row_kernels
    assert all(nonzero), "a checked step had no LoRA delta: the comparison proved nothing"


def launched_tiles(meta: Any, rows: int, tiles: Any) -> Any:
    """The LoraTiles lora_groups launches a one-module group of `rows` rows with on `meta` (a
    graph's context's), starting from `tiles`."""
    from slora_kernels.lora import LoraTiles, lora_groups

    assert meta is not None
    x = torch.zeros(rows, 8)
    tables = torch.zeros(2, 1, dtype=torch.int64), torch.ones(2, 1, dtype=torch.int32)
    (group,) = lora_groups(x, torch.zeros(64), tables[0], tables[0], tables[1],
                           torch.ones(2, 1), (0,), ((0, 8),), meta, max_rank=8, tiles=tiles)
    assert isinstance(group.tiles, LoraTiles)
    return group.tiles


def check_switch_keeps_each_way(graphs: Any, modes: Any, attr: str, taken: int,
                                keys: list[Any] | None = None) -> None:
    """A bench.distinct_adapters.GraphSwitch made while `attr` is off: on, it takes the graphs
    of the first `taken` of `keys` (by default a decode tile list's, the row kernels', a base
    graph's) and leaves the rest; a graph captured while on is kept apart, and switching back
    and forth restores each way's own."""
    mods = frozenset({0})
    keys = keys or [(64, mods, 33), (64, mods, ROW_GRAPH), (64, frozenset(), 0)]
    for k in keys:
        graphs.graphs[k], graphs.logits[k], graphs.contexts[k] = f"graph {k}", None, None
    modes.set(True)
    assert getattr(graphs, attr) and set(graphs.graphs) == set(keys[taken:])
    graphs.graphs[keys[0]], graphs.logits[keys[0]], graphs.contexts[keys[0]] = "on", None, None
    modes.set(False)
    assert not getattr(graphs, attr)
    assert all(graphs.graphs[k] == f"graph {k}" for k in keys)
    modes.set(True)
    assert graphs.graphs[keys[0]] == "on" and set(graphs.graphs) == {keys[0], *keys[taken:]}


def check_switch_keeps_each_variant(graphs: Any, modes: Any, keys: list[Any],
                                    variants: list[Any]) -> None:
    """A bench.distinct_adapters.GraphSwitch of tile overrides made while they are off (())
    takes the graph of the first of `keys` (a tile list's) for each variant and leaves the
    rest; a graph captured under each variant is kept apart, and the default, then each
    variant again, gets its own back."""
    for k in keys:
        graphs.graphs[k], graphs.logits[k], graphs.contexts[k] = f"graph {k}", None, None
    for i, v in enumerate(variants):
        modes.set(v)
        assert graphs.tile_overrides == v and set(graphs.graphs) == set(keys[1:])
        graphs.graphs[keys[0]], graphs.logits[keys[0]], graphs.contexts[keys[0]] = (
            f"variant {i}", None, None)
    modes.set(modes.default)
    assert graphs.tile_overrides == () and graphs.graphs[keys[0]] == f"graph {keys[0]}"
    for i, v in enumerate(variants):
        modes.set(v)
        assert graphs.graphs[keys[0]] == f"variant {i}"


def test_own_split_switch_swaps_only_the_tile_graphs(demo_dir: Path) -> None:
    """DecodeGraphs.own_split: tile lists pick the split for their own length, and
    bench.distinct_adapters.SplitModes keeps each rule's captured tile graphs apart (the
    row kernels' and base graphs stay)."""
    from bench.distinct_adapters import SplitModes

    engine = LLMEngine.from_model_dir(demo_dir / "model",
                                      EngineConfig(max_num_seqs=64, device="cpu"))
    graphs = engine.runner.graphs = DecodeGraphs(engine.runner, 64,
                                                 engine.config.max_model_len)
    mods = frozenset({0})
    assert graphs._context(64, mods, 33).lora.split_tiles == 64  # type: ignore[union-attr]
    graphs.own_split = True
    assert graphs._context(64, mods, 33).lora.split_tiles is None  # type: ignore[union-attr]
    graphs.own_split = False
    check_switch_keeps_each_way(graphs, SplitModes(engine), "own_split", taken=1)


def test_fork_switch_swaps_the_lora_graphs_and_forks_past_the_short_list(
        demo_dir: Path) -> None:
    """DecodeGraphs.fork_shrink (EngineConfig.lora_fork_shrink, on by default): the middle and
    full tile lists and the row kernels' graph get the side stream in their context, the short
    list and base graphs do not, and bench.distinct_adapters.ForkModes keeps each way's LoRA
    graphs apart (base graphs stay)."""
    from bench.distinct_adapters import ForkModes

    engine = LLMEngine.from_model_dir(demo_dir / "model",
                                      EngineConfig(max_num_seqs=64, device="cpu"))
    graphs = engine.runner.graphs = DecodeGraphs(engine.runner, 64,
                                                 engine.config.max_model_len)
    assert graphs.fork_shrink  # EngineConfig.lora_fork_shrink's default
    off = LLMEngine.from_model_dir(demo_dir / "model", EngineConfig(
        max_num_seqs=64, device="cpu", lora_fork_shrink=False))
    assert not DecodeGraphs(off.runner, 64, off.config.max_model_len).fork_shrink
    mods = frozenset({0})
    side = graphs.side = object()  # type: ignore[assignment]  # a CPU stand-in stream
    graphs.fork_shrink = False
    assert all(graphs._context(64, mods, t).lora_side is None for t in (4, 16, 33, ROW_GRAPH))
    graphs.fork_shrink = True
    assert graphs._context(64, mods, 4).lora_side is None  # the short list: cdiv(64, 16)
    assert all(graphs._context(64, mods, t).lora_side is side for t in (16, 33, ROW_GRAPH))
    assert graphs._context(64, frozenset(), 0).lora_side is None
    graphs.fork_shrink = False  # ForkModes' default is the engine's own: off here
    check_switch_keeps_each_way(graphs, ForkModes(engine), "fork_shrink", taken=2)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_forked_shrinks_give_the_in_line_tokens_and_logits(demo_dir: Path) -> None:
    """Decode graphs with the shrinks forked beside the base GEMMs (fork_shrink) replay the
    same kernels on the same inputs as in line: every greedy token and every logit of a batch
    of three adapters interleaved, on the tile lists and the row kernels' graph, is the same
    bit for bit."""
    names = sorted(p.name for p in (demo_dir / "adapters").iterdir())[:3]
    engine = LLMEngine.from_model_dir(demo_dir / "model",
                                      EngineConfig(max_num_seqs=64, device="cuda"))
    for name in names:
        engine.register_adapter(name, demo_dir / "adapters" / name)
    graphs = engine.runner.graphs
    assert graphs is not None
    logits: dict[bool, list[torch.Tensor]] = {False: [], True: []}
    run = engine.runner.run

    def keep(scheduled, patch=None):  # type: ignore[no-untyped-def]
        out = run(scheduled, patch)
        logits[graphs.fork_shrink].append(out.float().cpu().clone())
        return out

    engine.runner.run = keep  # type: ignore[method-assign]
    params = SamplingParams(temperature=0, max_new_tokens=6, ignore_eos=True)
    tokens: dict[bool, dict[str, list[int]]] = {}
    for fork in (False, True):
        graphs.take_lora_graphs()  # captured again the other way
        graphs.fork_shrink = fork
        done: dict[str, list[int]] = {}
        for n, rows in (("mid", 60), ("row", 3)):  # the middle list; a row an adapter
            for i in range(rows):
                engine.add_request(f"{fork}:{n}{i}", [13, 14 + i], params,
                                   adapter=names[i % 3])
            while engine.has_unfinished():
                for out in engine.step():
                    done.setdefault(out.request_id.split(":")[1], []).extend(out.token_ids)
        assert all(len(t) == 6 for t in done.values()) and len(done) == 63
        tokens[fork] = done
    assert tokens[False] and tokens[False] == tokens[True]
    assert len(logits[False]) == len(logits[True]) > 0
    assert all(torch.equal(a, b) for a, b in zip(logits[False], logits[True], strict=True))


def test_decode_tile_lists_take_one_stage_and_the_switch_keeps_both_ways(
        demo_dir: Path) -> None:
    """Every decode graph's tile list, the short one too, launches with GRAPH_TILE_STAGES
    pipeline stages (a LoraMeta.tile_overrides entry, which lora_groups applies); the row
    kernels have none. bench.distinct_adapters.StageModes keeps each way's tile graphs apart."""
    from bench.distinct_adapters import StageModes
    from slora_core.cuda_graphs import GRAPH_TILE_STAGES
    from slora_kernels.lora import DECODE_TILES

    engine = LLMEngine.from_model_dir(demo_dir / "model",
                                      EngineConfig(max_num_seqs=64, device="cpu"))
    graphs = engine.runner.graphs = DecodeGraphs(engine.runner, 64,
                                                 engine.config.max_model_len)
    mods = frozenset({0})

    def stages(tiles: int) -> int | None:
        meta = graphs._context(64, mods, tiles).lora
        assert meta is not None
        return dict(meta.tile_overrides).get("num_stages")

    assert graphs.one_stage and DECODE_TILES.num_stages != GRAPH_TILE_STAGES
    assert stages(ROW_GRAPH) is None
    assert stages(4) == stages(16) == stages(33) == GRAPH_TILE_STAGES  # short: cdiv(64, 16)
    assert launched_tiles(graphs._context(64, mods, 16).lora, 64, dataclasses.replace(
        DECODE_TILES, shrink_block_k=16)).num_stages == GRAPH_TILE_STAGES
    graphs.one_stage = False  # StageModes' default is the engine's own: off here
    assert stages(4) is None and stages(16) is None
    check_switch_keeps_each_way(graphs, StageModes(engine), "one_stage", taken=1)


def test_mixed_tile_lists_take_their_tiles_stages_and_the_switch_keeps_both_ways(
        demo_dir: Path) -> None:
    """Mixed graphs' tile lists launch with their tiles' stages (64-row tiles:
    PREFILL_STAGES); off (MixedGraphs.own_stages), with two, as before.
    bench.distinct_adapters.MixedStageModes keeps each way's tile graphs apart."""
    from bench.distinct_adapters import MixedStageModes
    from slora_core.cuda_graphs import TWO_STAGES, MixedGraphs
    from slora_kernels.lora import PREFILL_STAGES, PREFILL_TILES

    engine = LLMEngine.from_model_dir(demo_dir / "model",
                                      EngineConfig(max_num_seqs=64, device="cpu"))
    mixed = engine.runner.mixed = MixedGraphs(engine.runner, 64, 4096,
                                              engine.config.max_model_len)
    mods = frozenset({0})
    bucket = mixed.buckets[-1]
    assert mixed._tile_rows(bucket) == PREFILL_TILES.shrink_block_m != DECODE_BLOCK_M
    assert PREFILL_TILES.num_stages == PREFILL_STAGES != TWO_STAGES

    def launched_stages() -> int:
        return int(launched_tiles(mixed._context(bucket, mods, mixed._tile_cap(bucket)).lora,
                                  bucket, dataclasses.replace(PREFILL_TILES,
                                                              shrink_block_k=16)).num_stages)

    assert mixed.own_stages and launched_stages() == PREFILL_STAGES
    mixed.own_stages = False  # MixedStageModes' default is the engine's own: off here
    assert launched_stages() == TWO_STAGES
    check_switch_keeps_each_way(mixed, MixedStageModes(engine), "own_stages", taken=1, keys=[
        (bucket, mods, mixed._tile_cap(bucket)), (bucket, frozenset(), 0)])


def test_tile_overrides_reach_the_tile_launches_and_the_switch_keeps_both_ways(
        demo_dir: Path) -> None:
    """The tile lists past the short one launch their expands with four 128-column tiles a
    program, pipelined (MANY_TILE_OVERRIDES), the short one with its tiles' own.
    DecodeGraphs.tile_overrides, where set, go to every tile list's meta instead (not the row
    kernels'), and lora_groups launches with them (a shrink K tile, the expand's column
    tiles). bench.distinct_adapters.TileModes keeps each variant's tile graphs apart and puts
    the default back. Float32 models keep their own tiles on every list."""
    from bench.distinct_adapters import TILE_VARIANTS, TileModes
    from slora_core.cuda_graphs import MANY_TILE_OVERRIDES
    from slora_kernels.lora import DECODE_TILES, LoraTiles

    engine = LLMEngine.from_model_dir(demo_dir / "model",
                                      EngineConfig(max_num_seqs=64, device="cpu"))
    graphs = engine.runner.graphs = DecodeGraphs(engine.runner, 64,
                                                 engine.config.max_model_len)
    mods = frozenset({0})

    def launched(tiles: int) -> LoraTiles:
        return launched_tiles(graphs._context(64, mods, tiles).lora, 64,
                              dataclasses.replace(DECODE_TILES, shrink_block_k=16))

    assert graphs.tile_overrides == ()
    half = LLMEngine.from_model_dir(demo_dir / "model", EngineConfig(
        max_num_seqs=64, device="cpu", dtype="float16"))
    assert DecodeGraphs(half.runner, 64, 64).many_tile_overrides == MANY_TILE_OVERRIDES
    full = LLMEngine.from_model_dir(demo_dir / "model", EngineConfig(
        max_num_seqs=64, device="cpu", dtype="float32"))
    assert DecodeGraphs(full.runner, 64, 64).many_tile_overrides == ()
    graphs.many_tile_overrides = MANY_TILE_OVERRIDES  # the 16-bit rule on this engine
    short, many = launched(4), launched(16)  # the short list: cdiv(64, 16)
    assert (short.expand_cols, short.expand_block_n) == (
        DECODE_TILES.expand_cols, DECODE_TILES.expand_block_n) == (1, 256)
    assert (many.expand_cols, many.expand_block_n) == (4, 128)
    assert launched(33) == many and many.shrink_block_k == 16 and many.num_stages == 1
    graphs.many_tile_overrides = ()
    assert launched(16) == short
    graphs.many_tile_overrides = MANY_TILE_OVERRIDES
    graphs.tile_overrides = TILE_VARIANTS["k128"]  # instead of the many lists' too
    assert launched(4).shrink_block_k == launched(33).shrink_block_k == 128
    assert launched(16).num_stages == 1 and launched(16).expand_cols == 1
    graphs.tile_overrides = TILE_VARIANTS["n128cols4a"]  # on the short list too
    assert launched(4) == many
    graphs.tile_overrides = TILE_VARIANTS["cols1"]  # the many lists as before them
    assert launched(16) == short
    row = graphs._context(64, mods, ROW_GRAPH).lora
    assert row is not None and row.tile_overrides == ()
    graphs.tile_overrides = ()

    check_switch_keeps_each_variant(
        graphs, TileModes(engine), [(64, mods, 33), (64, mods, ROW_GRAPH), (64, frozenset(), 0)],
        [TILE_VARIANTS["k128"], TILE_VARIANTS["cols1"]])


def test_mixed_tile_overrides_reach_only_the_64_row_lists(demo_dir: Path) -> None:
    """MixedGraphs.tile_overrides go to the 64-row tile lists' launches (buckets over
    SHORT_TILES_MAX_TOKENS), not the 16-row ones'; bench.distinct_adapters.MixedTileModes
    keeps each variant's tile graphs apart and puts the default back."""
    from bench.distinct_adapters import TILE_VARIANTS, MixedTileModes
    from slora_core.cuda_graphs import MixedGraphs
    from slora_kernels.lora import DECODE_TILES, PREFILL_TILES

    engine = LLMEngine.from_model_dir(demo_dir / "model",
                                      EngineConfig(max_num_seqs=64, device="cpu"))
    mixed = engine.runner.mixed = MixedGraphs(engine.runner, 64, 4096,
                                              engine.config.max_model_len)
    mods = frozenset({0})
    wide, narrow = mixed.buckets[-1], mixed.buckets[0]
    assert mixed._tile_rows(wide) == PREFILL_TILES.shrink_block_m
    assert mixed._tile_rows(narrow) == DECODE_BLOCK_M

    def launched(bucket: int) -> Any:
        base = PREFILL_TILES if bucket == wide else DECODE_TILES
        return launched_tiles(mixed._context(bucket, mods, mixed._tile_cap(bucket)).lora,
                              bucket, dataclasses.replace(base, shrink_block_k=16))

    assert mixed.tile_overrides == () and launched(wide).expand_cols == 4  # PREFILL_TILES'
    mixed.tile_overrides = TILE_VARIANTS["mixed_cols1"]
    assert launched(wide).expand_cols == 1
    assert launched(wide).expand_block_n == PREFILL_TILES.expand_block_n
    assert launched(narrow).expand_cols == 1
    mixed.tile_overrides = ()

    check_switch_keeps_each_variant(
        mixed, MixedTileModes(engine), [(wide, mods, mixed._tile_cap(wide)),
                                        (wide, frozenset(), 0)],
        [TILE_VARIANTS["mixed_cols1"], (("expand_cols", 2),)])
