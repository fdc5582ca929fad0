"""Many distinct adapters in one batch against the base model (issue 37): a decode-heavy batch of
`--distinct-batch` requests, all arriving at once, each on adapter `i % D` for D distinct
adapters (ranks 8, 16, 32, 64 in turn, all seven modules), replayed on one engine beside the
same requests on the base model, interleaved (base, D=16, D=64, one adapter unmerged, base, ...)
so every arm sees the same clocks and warmed state.

    python -m bench.serving --shape llama2-7b --device cuda --scenarios distinct \
        --out bench/results/distinct-adapters-h200.json

The result is written after every repeat (`Bench.checkpoint`): a run cut short by its time
limit keeps what it measured, marked `cut_short`, and never reads `met`. `--distinct-arms`
runs a subset of the arms beside base.

With `--ride-sole-adapter` the one-adapter arm rides (slora_core/lora_ride.py) and a
`one_kernels` arm runs the same requests on the LoRA kernels, side by side. `--ride-variants`
adds one-adapter arms riding with other launches or rows (RIDE_VARIANTS: every expand as addmm,
o's and down's as addmm, every module's rows at max_rank, the wide outputs' row stride not
padded to RIDE_ROW_ALIGN or padded to 64), each on its own captured graphs, in
the same interleaving. `--one-adapter-rank` picks the rank of that arm's adapter.

Targets (issue 37): D=16 at least 0.95x base throughput, D=64 at least 0.92x, one adapter with
the sole-adapter merge off at least 0.97x. Punica reports 91.6% of base with distinct adapters.

`--full-list-arms` adds, for each arm named, the same requests with every tile step replaying
the longest tile list instead of the middle one (`DecodeGraphs.use_mid_tiles` off), in
the same interleaving: what the middle list (decode_tile_caps) is worth. `--own-split-arms`
likewise runs arms with every tile list's K split picked for its own length
(`DecodeGraphs.own_split`) instead of decode_split_tiles's. `--in-line-arms` runs arms with
decode graphs' many-adapter LoRA shrinks in line after the base GEMMs instead of on a second
stream beside them (`DecodeGraphs.fork_shrink` off; on by default since cb90780's run,
distinct-adapters-fork-cb90780-h100.json, where `--fork-arms` ran the fork as the variant).
"""

from __future__ import annotations

import argparse
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from bench.replay import replay
from bench.workload import BenchRequest
from devtools.synthetic import random_adapter, shared_weight_view
from slora_core.config import LORA_MODULES
from slora_core.lora_ride import RIDE_ROW_ALIGN

if TYPE_CHECKING:
    from bench.serving import Bench
    from slora_core.engine import LLMEngine
    from slora_core.lora_merge import SoleAdapterMerge
    from slora_core.lora_ride import SoleAdapterRide

RANKS = (8, 16, 32, 64)
TARGETS = {"distinct16": 0.95, "distinct64": 0.92, "one_unmerged": 0.97}
ARMS = {"distinct16": 16, "distinct64": 64, "one_unmerged": 1}  # arm -> distinct adapters


# --ride-variants: one-adapter arms riding with other launches than the default's, as
# (SoleAdapterRide.fused_consumers, .triton_expands, .rank_sized, .row_align); each result
# records its arms' fields. addmm: every expand an addmm (the ride before 7c40866); nopdl: o's
# and down's expands an addmm (the default at 5be1284); triton: o's and down's in Triton (the
# default since); maxrows: every module's rows at max_rank (the ride before 960db69);
# unaligned, align64: the wide outputs' row stride unpadded or padded to 64 (16 since
# 91d9eee). The PDL variant went with the PDL launches (removed after 5be1284); norm with the
# norm fusion (ca134db; back at 3ceb912 with the expand matrix read as one tile and removed
# again: on an H100 0.985x against the default's 0.984x at rank 8, 0.956x against 0.978x at
# rank 16, distinct-adapters-norm{,-r16}-3ceb912-h100.json); m32, m64 and w8 (a field
# expand_blocks: the Triton expands launched 32 or 64 rows, or 16 rows and 8 warps, a
# program) with the launch-shape switch after d3cf840 and 4325d23, where none beat the
# default (docs/performance.md).
RIDE_VARIANTS = {"addmm": (False, False, True, RIDE_ROW_ALIGN),
                 "nopdl": (True, False, True, RIDE_ROW_ALIGN),
                 "triton": (True, True, True, RIDE_ROW_ALIGN),
                 "maxrows": (True, True, False, RIDE_ROW_ALIGN),
                 "unaligned": (True, True, True, 1), "align64": (True, True, True, 64)}
RIDE_MODE_FIELDS = "fused_consumers, triton_expands, rank_sized, row_align"
RideMode = tuple[bool, bool, bool, int]


def parse_names(text: str, known: Iterable[str], what: str) -> tuple[str, ...]:
    """Comma-separated names from `known` (may be empty); another is a usage error naming
    `what` they are."""
    known = tuple(known)
    chosen = tuple(n.strip() for n in text.split(",") if n.strip())
    unknown = [n for n in chosen if n not in known]
    if unknown:
        raise argparse.ArgumentTypeError(
            f"{text!r}: unknown {what} {', '.join(unknown)} (choose from {', '.join(known)})")
    return chosen


def parse_ride_variants(text: str) -> tuple[str, ...]:
    """`--ride-variants`: names from RIDE_VARIANTS."""
    return parse_names(text, RIDE_VARIANTS, "ride variants")


class RideModes:
    """Switches the ride's launches between arms, keeping each mode's captured ride graphs
    (a captured graph replays the launches it was captured with)."""

    def __init__(self, engine: LLMEngine, ride: SoleAdapterRide) -> None:
        self.runner, self.ride = engine.runner, ride
        self.mode: RideMode = (ride.fused_consumers, ride.triton_expands, ride.rank_sized,
                               ride.row_align)
        self.default = self.mode
        self.stash: dict[tuple[RideMode, int], dict[Any, Any]] = {}

    def set(self, mode: RideMode) -> None:
        if mode == self.mode:
            return
        for i, graphs in enumerate((self.runner.graphs, self.runner.mixed)):
            if graphs is not None:
                self.stash[(self.mode, i)] = graphs.take_ride()
                graphs.put(self.stash.pop((mode, i), {}))
        self.ride.fused_consumers, self.ride.triton_expands = mode[0], mode[1]
        self.ride.row_align = mode[3]
        if mode[2] != self.ride.rank_sized:  # the rows' layout changes: load them again
            self.ride.rank_sized, self.ride.loaded = mode[2], None
        self.mode = mode


class GraphSwitch:
    """Switches an attribute of a graph set (`attr` of the runner's `where`: the decode graphs
    or the mixed ones) between arms, keeping each value's captured graphs (those `take`
    removes: a graph replays what it was captured with); `default` is the engine's own value
    (`off` without the graph set)."""

    attr = ""
    take = ""
    where = "graphs"
    off: Any = False

    def __init__(self, engine: LLMEngine) -> None:
        self.graphs = getattr(engine.runner, self.where)
        self.default = getattr(self.graphs, self.attr) if self.graphs is not None else self.off
        self.stash: dict[Any, dict[Any, Any]] = {}

    def set(self, value: Any) -> None:
        g = self.graphs
        if g is None:
            return
        now = getattr(g, self.attr)
        if now == value:
            return
        self.stash[now] = getattr(g, self.take)()
        g.put(self.stash.pop(value, {}))
        setattr(g, self.attr, value)


class SplitModes(GraphSwitch):
    """The tile lists' K split rule (DecodeGraphs.own_split), their graphs kept apart."""

    attr, take = "own_split", "take_tile_graphs"


class ForkModes(GraphSwitch):
    """Many-adapter LoRA with its shrinks forked beside the base GEMMs or in line
    (DecodeGraphs.fork_shrink), every LoRA graph but the ride's kept apart."""

    attr, take = "fork_shrink", "take_lora_graphs"


class StageModes(GraphSwitch):
    """Decode graphs' tile lists with one pipeline stage or their tiles' two
    (DecodeGraphs.one_stage, GRAPH_TILE_STAGES), the tile lists' graphs kept apart."""

    attr, take = "one_stage", "take_tile_graphs"


class TileModes(GraphSwitch):
    """Decode graphs' tile lists launched with LoraTiles fields of a variant
    (DecodeGraphs.tile_overrides, TILE_VARIANTS) or their tiles' own, each way's tile graphs
    kept apart."""

    attr, take, off = "tile_overrides", "take_tile_graphs", ()


class MixedTileModes(GraphSwitch):
    """Mixed graphs' 64-row tile lists launched with LoraTiles fields of a variant
    (MixedGraphs.tile_overrides; TILE_VARIANTS' `mixed_` ones) or PREFILL_TILES' own, each
    way's tile graphs kept apart."""

    attr, take, off, where = "tile_overrides", "take_tile_graphs", (), "mixed"


# --tile-variants: decode graphs' tile lists launched with other LoraTiles fields, each
# replacing the lists' own (MANY_TILE_OVERRIDES past the short list); those named `mixed_`
# apply to mixed graphs' 64-row lists instead (prompt chunks and mixed steps of over
# SHORT_TILES_MAX_TOKENS tokens; MixedGraphs.tile_overrides). At 51483c3 (an H100,
# 1 of 3 repeats, distinct-adapters-tiles-51483c3-h100.json) 16 distinct adapters kept 0.810x
# of base as before, 0.824x with four pipelined 128-column tiles an expand program (kept:
# MANY_TILE_OVERRIDES), 0.802x with a shrink K tile of 128, 0.766x with two 256-column tiles
# held in registers by hand and 0.748x with registers capped at 128 (both removed).
TILE_VARIANTS: dict[str, tuple[tuple[str, int], ...]] = {
    "k128": (("shrink_block_k", 128),),
    "n128cols4a": (("expand_block_n", 128), ("expand_cols", 4)),
    # One 256-column tile an expand program on every list: the lists past the short one as
    # before MANY_TILE_OVERRIDES.
    "cols1": (("expand_block_n", 256), ("expand_cols", 1)),
    # Mixed steps' 64-row expands on one 128-column tile a program, as before PREFILL_TILES
    # took four. In one layer four won; two and eight of 64 columns lost to four by 3-8%
    # (lora-distinct-layer-mixed-cols-f770983-h100.json) and were removed.
    "mixed_cols1": (("expand_cols", 1),),
}


def parse_tile_variants(text: str) -> tuple[str, ...]:
    """`--tile-variants`: names from TILE_VARIANTS."""
    return parse_names(text, TILE_VARIANTS, "tile variants")


class MixedStageModes(GraphSwitch):
    """Mixed graphs' 64-row tile lists with their tiles' stages (PREFILL_STAGES) or two
    (MixedGraphs.own_stages), the tile lists' graphs kept apart."""

    attr, take, where = "own_stages", "take_tile_graphs", "mixed"


def parse_arms(text: str) -> tuple[str, ...]:
    """`--distinct-arms`: comma-separated names from ARMS, at least one."""
    chosen = tuple(n.strip() for n in text.split(",") if n.strip())
    unknown = [n for n in chosen if n not in ARMS]
    if not chosen or unknown:
        raise argparse.ArgumentTypeError(
            f"{text!r}: choose one or more of {', '.join(ARMS)}"
            + (f" (unknown: {', '.join(unknown)})" if unknown else ""))
    return chosen


def parse_many_arms(text: str) -> tuple[str, ...]:
    """`--full-list-arms`, `--own-split-arms`: comma-separated many-adapter arms (may be
    empty)."""
    chosen = tuple(n.strip() for n in text.split(",") if n.strip())
    many = [n for n, d in ARMS.items() if d > 1]
    unknown = [n for n in chosen if n not in many]
    if unknown:
        raise argparse.ArgumentTypeError(
            f"{text!r}: unknown arms {', '.join(unknown)} (choose from {', '.join(many)})")
    return chosen


def distinct_requests(b: Bench, num_distinct: int | None) -> list[BenchRequest]:
    """The batch: the same prompts and lengths for every arm, adapter i % D (None: base); with
    one adapter, the first of rank --one-adapter-rank (a0, rank 8, by default)."""
    a = b.args
    rng = np.random.default_rng(7)
    one = RANKS.index(a.one_adapter_rank)
    reqs = []
    for i in range(a.distinct_batch):
        prompt = rng.integers(3, b.cfg.vocab_size, int(rng.integers(64, a.distinct_input + 1)))
        adapter = (None if num_distinct is None else one if num_distinct == 1
                   else i % num_distinct)
        reqs.append(BenchRequest(0.0, adapter, prompt.tolist(), a.distinct_output))
    return reqs


def distinct_engine(b: Bench) -> tuple[LLMEngine, SoleAdapterMerge | None]:
    """The engine every arm runs on: 64 adapters a0..a63 (ranks 8-64 in turn, all seven
    modules) and the merge taken off, returned for the caller to put back. Every arm runs
    LoRA unmerged: with the merge off, one adapter takes the path a refused merge takes, and
    the many-adapter arms never merge anyway."""
    a = b.args
    engine = b.engine(0, RANKS, max_adapters_per_batch=max(64, a.distinct_batch),
                      max_num_seqs=max(a.distinct_batch, 64))
    pin = a.device.startswith("cuda")
    bases = {r: random_adapter(b.cfg, r, modules=tuple(LORA_MODULES), dtype=b.dtype, seed=r,
                               pin_memory=pin) for r in RANKS}
    for i in range(64):
        engine.add_adapter(f"a{i}", shared_weight_view(bases[RANKS[i % len(RANKS)]], i))
    merge = engine.runner.merge
    if merge is not None:
        merge.unmerge()
        engine.runner.merge = None
    return engine, merge


def scenario_distinct(b: Bench) -> dict[str, Any]:
    a = b.args
    if a.ride_variants and not (a.ride_sole_adapter and "one_unmerged" in a.distinct_arms):
        raise SystemExit("--ride-variants needs --ride-sole-adapter and the one_unmerged arm")
    for flag, named in (("--full-list-arms", a.full_list_arms),
                        ("--own-split-arms", a.own_split_arms),
                        ("--in-line-arms", a.in_line_arms),
                        ("--two-stage-arms", a.two_stage_arms),
                        ("--mixed-two-stage-arms", a.mixed_two_stage_arms),
                        ("--tile-variant-arms", a.tile_variant_arms)):
        if not set(named) <= set(a.distinct_arms):
            raise SystemExit(f"{flag} names arms not in --distinct-arms")
    if bool(a.tile_variant_arms) != bool(a.tile_variants):
        raise SystemExit("--tile-variant-arms and --tile-variants go together")
    for flag, staged in (("--two-stage-arms", a.two_stage_arms),
                         ("--mixed-two-stage-arms", a.mixed_two_stage_arms),
                         ("--tile-variant-arms", a.tile_variant_arms)):
        if a.ride_sole_adapter and "one_unmerged" in staged:
            raise SystemExit(f"{flag}: one_unmerged rides with --ride-sole-adapter, on no "
                             "tile list (leave the ride off to stage its tile list)")
    engine, merge = distinct_engine(b)
    targets = {n: t for n, t in TARGETS.items() if n in a.distinct_arms}
    arms = {"base": distinct_requests(b, None),
            **{n: distinct_requests(b, d) for n, d in ARMS.items() if n in a.distinct_arms}}
    # With the sole-adapter ride on (--ride-sole-adapter), one_unmerged rides and the same
    # requests also run on the LoRA kernels (the ride switched off for that arm).
    ride = engine.runner.ride
    modes = RideModes(engine, ride) if ride is not None else None
    variants = {f"one_ride_{v}": RIDE_VARIANTS[v] for v in a.ride_variants}
    if ride is not None and "one_unmerged" in arms:
        arms["one_kernels"] = arms["one_unmerged"]
        arms.update({name: arms["one_unmerged"] for name in variants})
    def same_requests(named: tuple[str, ...], suffix: str) -> dict[str, str]:
        """Arms `{name}_{suffix}` running the requests of each named arm (run ones only)."""
        extra = {f"{n}_{suffix}": n for n in named if n in arms}
        arms.update({name: arms[n] for name, n in extra.items()})
        return extra

    # --full-list-arms: the same requests with every tile step on the longest tile list
    # (DecodeGraphs.use_mid_tiles off), as decode graphs replayed before the middle one.
    full_list = same_requests(a.full_list_arms, "full_list")
    # --own-split-arms: the same requests with every tile list's K split picked for its own
    # length (DecodeGraphs.own_split), each way's graphs kept (SplitModes).
    own_split = same_requests(a.own_split_arms, "own_split")
    splits = SplitModes(engine)
    # --in-line-arms: the same requests with the shrinks in line after the base GEMMs.
    in_line = same_requests(a.in_line_arms, "in_line")
    forks = ForkModes(engine)
    # --two-stage-arms: the same requests with decode graphs' tile lists on two pipeline
    # stages, as before GRAPH_TILE_STAGES.
    two_stage = same_requests(a.two_stage_arms, "two_stage")
    stages = StageModes(engine)
    # --mixed-two-stage-arms: the same requests with mixed graphs' 64-row tile lists on two
    # pipeline stages, as before PREFILL_STAGES.
    mixed_two = same_requests(a.mixed_two_stage_arms, "mixed_two_stage")
    mixed_stages = MixedStageModes(engine)
    # --tile-variant-arms with --tile-variants: the same requests with decode graphs' tile
    # lists, or with a `mixed_` variant mixed graphs' 64-row ones, launched with each
    # variant's LoraTiles fields (TILE_VARIANTS).
    tile_arms = {name: v for v in a.tile_variants
                 for name in same_requests(a.tile_variant_arms, f"tiles_{v}")}
    tile_modes, mixed_tile_modes = TileModes(engine), MixedTileModes(engine)
    extra_arms = tuple(n for n in ("one_kernels", *variants, *full_list, *own_split, *in_line,
                                   *two_stage, *mixed_two, *tile_arms) if n in arms)
    ratio_arms = (*targets, *extra_arms)

    def run_arm(name: str, label: str) -> dict[str, Any]:
        engine.runner.ride = None if name == "one_kernels" else ride
        if engine.runner.graphs is not None:
            engine.runner.graphs.use_mid_tiles = name not in full_list
        splits.set(name in own_split)
        forks.set(forks.default and name not in in_line)
        stages.set(stages.default and name not in two_stage)
        mixed_stages.set(mixed_stages.default and name not in mixed_two)
        variant = tile_arms.get(name, "")
        fields = TILE_VARIANTS.get(variant, ())
        mixed = variant.startswith("mixed_")
        tile_modes.set(fields if variant and not mixed else tile_modes.default)
        mixed_tile_modes.set(fields if mixed else mixed_tile_modes.default)
        if modes is not None:
            modes.set(variants.get(name, modes.default))
        return replay(engine, arms[name], label)

    bound = bytes_bound(b, arms)

    def summary(runs: list[dict[str, Any]]) -> dict[str, Any]:
        out: dict[str, Any] = {"repeats": runs, "batch": a.distinct_batch, "ranks": RANKS,
                               "one_adapter_rank": a.one_adapter_rank,
                               "modules": list(LORA_MODULES), "targets": TARGETS,
                               "arms_left_out": [n for n in TARGETS if n not in targets]}
        if len(runs) < a.overhead_repeats:  # written after each repeat; a cut run keeps it
            out["cut_short"] = f"{len(runs)} of {a.overhead_repeats} repeats"
        if not runs:
            out["met"] = False
            return out
        for name, target in targets.items():
            ratios = [r[f"{name}_ratio"] for r in runs]
            med = float(np.median(ratios))
            out[name] = {"throughput_ratio": med, "ratio_min": min(ratios),
                         "ratio_max": max(ratios), "target": target, "met": med >= target,
                         "distinct_adapters_per_step": float(np.median(
                             [r[name]["distinct_adapters_per_step_mean"] for r in runs])),
                         "bytes_bound": bound[name]["throughput_ratio_bound"],
                         "of_bytes_bound": med / bound[name]["throughput_ratio_bound"]}
        # Met only when every target's arm ran, every repeat, and met it.
        out["met"] = (not out["arms_left_out"] and "cut_short" not in out
                      and all(out[name]["met"] for name in targets))
        for name in extra_arms:
            ratios = [r[f"{name}_ratio"] for r in runs]
            out[name] = {"throughput_ratio": float(np.median(ratios)),
                         "ratio_min": min(ratios), "ratio_max": max(ratios)}
            if name in variants:
                out[name][RIDE_MODE_FIELDS] = list(variants[name])
        if modes is not None:
            out["ride"] = {"loads": modes.ride.loads, "ride_steps": modes.ride.ride_steps,
                           "rows_last_load": modes.ride.rows,
                           "rows_bytes": modes.ride.nbytes,
                           f"one_unmerged {RIDE_MODE_FIELDS}": list(modes.default)}
        out["bytes_bound"] = bound
        return out

    runs: list[dict[str, Any]] = []
    b.checkpoint("distinct", summary(runs))
    for name in arms:  # untimed: loads every adapter, captures every graph
        run_arm(name, f"warm {name}")
    for i in range(a.overhead_repeats):
        run = {name: run_arm(name, f"{name} {i + 1}") for name in arms}
        for name in ratio_arms:
            run[f"{name}_ratio"] = (run[name]["output_tok_per_s"]
                                    / run["base"]["output_tok_per_s"])
        runs.append(run)
        if len(runs) < a.overhead_repeats:
            b.checkpoint("distinct", summary(runs))
    engine.runner.merge, engine.runner.ride = merge, ride
    if engine.runner.graphs is not None:
        engine.runner.graphs.use_mid_tiles = True
    splits.set(False)
    forks.set(forks.default)
    stages.set(stages.default)
    if modes is not None:
        modes.set(modes.default)
    return summary(runs)


def bytes_bound(b: Bench, arms: dict[str, list[BenchRequest]]) -> dict[str, Any]:
    """What reading each arm's bytes once allows: a decode step reads the weights, the batch's
    KV (at its mean context over the decode, prompt + half the output) and every distinct
    adapter of the batch, so with memory-bound steps an arm can keep at most
    (weights + KV) / (weights + KV + its adapters) of the base model's throughput."""
    elem = torch.finfo(b.dtype).bits // 8
    weights = sum(p.numel() * p.element_size() for p in b.model.parameters())
    kv_token = b.cfg.num_hidden_layers * 2 * b.cfg.num_key_value_heads * b.cfg.head_dim * elem
    per_rank = b.cfg.num_hidden_layers * elem * sum(sum(b.cfg.module_shape(m))
                                                    for m in LORA_MODULES)
    out: dict[str, Any] = {}
    for name, reqs in arms.items():
        kv = kv_token * sum(len(r.prompt) + r.output_len / 2 for r in reqs)
        ids = {r.adapter for r in reqs if r.adapter is not None}
        adapters = sum(RANKS[i % len(RANKS)] * per_rank for i in ids)
        out[name] = {"weights": weights, "kv": int(kv), "adapters": adapters,
                     "throughput_ratio_bound": (weights + kv) / (weights + kv + adapters)}
    return out
