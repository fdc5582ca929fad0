"""`add_lora_triton`: the multi-LoRA delta as a shrink and an expand launch per module group.

Same signature and semantics as `slora_kernels.lora_reference.add_lora_reference` (y += the delta of
x for every adapter segment, several modules in one launch, output added in place into y's
column slices), plus keyword-only tuning knobs. The float32 intermediate holds x @ A.T for each
token and module, split along K when there are too few segments to fill the GPU.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from functools import lru_cache
from typing import Any

import torch
import triton

from slora_kernels.lora_common import MAX_MODULES_PER_LAUNCH, check_rows, pdl_supported
from slora_kernels.lora_expand import lora_expand
from slora_kernels.lora_meta import DECODE_BLOCK_M, PREFILL_BLOCK_M, ROW_BLOCK_M, LoraMeta
from slora_kernels.lora_rows import RowTiles, rows_expand, rows_shrink
from slora_kernels.lora_shrink import lora_shrink


@dataclass(frozen=True)
class LoraTiles:
    """Block sizes of one shrink+expand pair (powers of two, >= 16 where they feed tl.dot)."""

    shrink_block_m: int
    shrink_block_k: int
    expand_block_m: int
    expand_block_n: int
    num_warps: int = 4
    num_stages: int = 2
    # Column tiles an expand program covers in turn (1: one, each its own program). At 64
    # decode rows a program's time is mostly a chain of dependent loads (the tile entry's
    # segment, slot, rank, offsets; its B tile; the shrink's sums), and a multiprocessor holds
    # three at rank bound 64, so the 768-1,376 programs of a 16-tile qkv or gate_up expand run
    # in 2-4 waves of that chain. Over 1, a program walks the chain once, sums the K splits
    # once, and the compiler's two-stage pipeline loads each next tile's B and y while the one
    # before is multiplied (114 registers a thread at four 128-column tiles, rank bound 64).
    # Decode graphs' many-adapter lists take four (slora_core.cuda_graphs.MANY_TILE_OVERRIDES),
    # and so do 64-row tiles (PREFILL_TILES).
    expand_cols: int = 1
    # The expand re-reads every K split's partial sums once per output tile, which costs more
    # than it saves once segments are long enough to fill the GPU with row tiles.
    max_split_k: int = 16  # MAX_SPLIT_K
    # The expand re-reads split_k x block_r partial sums per output tile: with a budget, the
    # split is capped at budget // block_r (None: no cap).
    split_rank_budget: int | None = None
    # Segments of rank <= 16 (<= 32) run 16- (32-) wide rank tiles instead of the launch's.
    rank_buckets: bool = True
    # The expand loads its y and B tiles before summing the K splits (their latency overlaps
    # the sum's), as the row kernels do. Decode launches of at most EARLY_LOADS_MAX_TILES
    # tiles always do (see there).
    early_loads: bool = False
    # Programmatic dependent launch (Hopper+, compiled kernels only): the expand is launched
    # as a dependent of its shrink, which lets it start at once, so the expand's launch and
    # its table, y and B loads overlap the shrink; only its sum of the partial sums waits
    # (`griddepcontrol.wait`). Safe because the shrink writes only the partial sums and
    # itself launches plainly, after whatever wrote y. On the H200 every case of the grid
    # gained, 1.5-3 us in launches under 20 us (one adapter: r16 B64 8.1 -> 6.1 us, r64 B16
    # 10.9 -> 7.8, r64 B64 11.9 -> 8.9; rows r16 B256 U256 28.8 -> 26.3), and serving one
    # adapter on every request went 0.933x -> 0.951x base throughput (prefill launches,
    # not in the grid, take it too; the engine runs include them)
    # (lora-grid-pdl-dccb3ce-h200.json, engine-speed-{pdl,nopdl}-dccb3ce-h200.json).
    pdl: bool = True
    # Removed after f979e18: `maxnreg`, registers a thread capped (ptxas spilling the rest).
    # At rank bound 64 a one-stage decode shrink is allocated 253 registers a thread (two
    # 4-warp programs a multiprocessor) and the expand 162 (three)
    # (kernel-compile-cost-f979e18-cpu.json); capped at 128, one 7B layer's LoRA at 64 rows,
    # 16 adapters, went 82.4 -> 115.7 us on an H100, at 168 to 77.5 alone but 234.2 -> 236.5
    # beside the GEMMs (lora-distinct-layer-regs-51483c3-h100.json).
    # Measured on the H200 and taken out (each lost or gained nothing at the engine's cases):
    # reading the K splits' sums four at a time in the expand (lora-grid-h200.json,
    # `split_unroll4`), the shrink's rank tile shared by four programs (r64 B64 U1 8.9 ->
    # 10.9 us, lora-grid-pdl-dccb3ce-h200.json), and the expand's second product as a 16-bit
    # dot (r64 B16 U1 8.0 -> 8.7 us, lora-grid-dot16-rejected-h200.json @ 0f38612).
    # Two ways of adding the K splits before the expand, so that it reads one sum instead
    # of re-reading every split once per column tile, were timed on the H200 and lost, so
    # neither is kept: the shrink's last split summing the others into the first (an atomic
    # counter a tile; r64 B256 U1 14.3 -> 15.9 us, r64 B16 8.5 -> 10.1,
    # lora-one-adapter-reduce-rejected-h200.json) and the splits added atomically into a
    # zeroed persistent sum the expand's last reader zeroed again (r64 B256 U1 14.4 -> 14.4,
    # r16 B256 U256 45.2 -> 48.3; lora-one-adapter-atomic-rejected-h200.json). Fewer splits
    # won there instead: 8 rather than 16 on a 16-tile list (r64 B256 U1 14.4 -> 12.8,
    # r16 9.2 -> 9.0), but lost on 4- and 1-tile lists (r64 B64 9.7 -> 10.1, B16 8.3 -> 8.7).
    # `wave_split` is that rule for short launches at rank tile 64: see `pick_split`. Timed on
    # the H200 beside the old split (lora-grid-split-h200.json @ 015e6a7, tf32 expand dot):
    # r64 B256 U1 short list 13.6 -> 12.2 us, r64 B16 U16 14.3 -> 12.9; at rank tile 16 it
    # lost (r16 B16 U16 7.3 -> 7.7, r16 B256 U1 short list 8.0 -> 8.2-8.3), so it keeps to
    # rank tile 64 (WAVE_SPLIT_MIN_RANK_TILE), where the re-read sums are 4x as wide.
    wave_split: bool = True
    # Removed after c337f04: at most N programs along the tile list, each shrink and expand
    # program looping over entries pid, pid + N, ... (`tile_programs`), so that a decode
    # graph's padded list (64 entries at 64 rows, 48 unused at 16 adapters) need not launch
    # a program an unused entry. Looping lost to those programs, which exit at once, on the
    # H100 (one 7B layer, 64 rows, 16 adapters: 87.6 us padded, 104.7 looping 16 programs,
    # 101.0 looping 32; 4 adapters 62.6, 70.3, 67.0; lora-distinct-layer-expand-c337f04-
    # h100.json). Decode graphs replay a middle list instead
    # (slora_core.cuda_graphs.decode_tile_caps).
    # Rank-balanced K splits (as `RowTiles.rank_balanced`: each tile's split in proportion to
    # its rank bucket, the split chosen for 4x the programs under 4x the caps) were timed on
    # the H100 and lost at every case, so they are not kept: one 7B decode layer, 64 rows,
    # 16 adapters of ranks 8-64, 86.7 -> 109.1 us; 64 adapters 218.2 -> 244.4; one rank-16
    # adapter on the short list 37.2 -> 40.2 (lora-distinct-layer-balanced-4cf2572-h100.json).
    # The expand re-reads every split's partial sums per column tile, 16 rows at a time: the
    # rank-64 tiles' 4x splits cost it more than the balance saves the shrink.


# Segments of at most 16 tokens (decode) pad to one 16-row tile; longer ones (prefill, or many
# decode requests on one adapter) use taller tiles so A and B are re-read less often.
DECODE_TILES = LoraTiles(shrink_block_m=DECODE_BLOCK_M, shrink_block_k=256,
                         expand_block_m=DECODE_BLOCK_M, expand_block_n=256)
# 64-row tiles (prompt chunks, mixed steps) run three pipeline stages (a shrink stage holds a
# 64 x 128 tile of x and a 128 x 64 tile of A, 32 KB). One 7B layer's mixed-step LoRA (64 decode
# rows and a prompt chunk) on an H100, graph replay, two stages -> three (one lost):
# 16 adapters of ranks 8-64 and a 512-token chunk 295.9 -> 251.9 us (one stage 330.2); 4 adapters
# and 2,048 tokens 447.9 -> 397.4 (460.3); 2 rank-16 adapters and 2,048 tokens 354.1 -> 325.0
# (345.8) (lora-distinct-layer-mixed-stages-002a98c-h100.json). In the engine (python -m bench
# issue37-mixed-stages-engine, H100, f63146d, cut after 2 of 3 repeats) the distinct batch's
# ~3,700-token mixed steps ran 1-3 ms faster (111-114 against 112-116 ms), 16 distinct adapters
# 0.810x of base against 0.808x, 64 0.696x against 0.695x
# (distinct-adapters-mixed-stages-f63146d-h100.json).
# Their expand programs cover four 128-column tiles each (expand_cols): the same layer on an
# H100, graph replay, one column tile a program -> four (two and eight of 64 columns lost to
# four): 252.4 -> 196.3 us, 402.6 -> 299.6, 323.5 -> 240.7, despite 242-244 registers a thread
# against 168, two programs a multiprocessor against three (kernel-compile-cost-2130f3a-cpu.json;
# lora-distinct-layer-mixed-cols-f770983-h100.json). In the engine, 16 distinct adapters
# 0.825x of base against 0.823x, ahead in all 3 repeats by 0.3-0.6% (mixed steps 107.7 against
# 111.0 ms; distinct-adapters-mixed-cols-20a18b8-h100.json).
PREFILL_STAGES = 3
PREFILL_TILES = LoraTiles(shrink_block_m=PREFILL_BLOCK_M, shrink_block_k=128,
                          expand_block_m=PREFILL_BLOCK_M, expand_block_n=128, max_split_k=2,
                          num_stages=PREFILL_STAGES, expand_cols=4)
# float32 models run exact (ieee) dots, which Triton lowers to FMAs unrolled over the whole
# tile: at the 16-bit tiles above, ptxas sees 1-1.7 MB of PTX and 18-26k declared registers a
# thread, and one prefill launch compiled for 28 s and a decode shrink for 32 s on the CPU
# (sm_90; a tiny float32 worker then took minutes to capture its graphs on the H200). These
# tiles compile in 5-13 s, like the 16-bit ones, with 3.7-6.9k registers declared
# (kernel-compile-f32-cpu.json: `python -m bench.kernel_compile_cost --float32`). Compiled
# as launches specialize them (kernel-compile-f32-1f9f044-cpu.json) every figure is smaller
# and the gap holds: 16-bit tiles 4.5-10.9 s with 11-23k registers declared, these 1.7-3.8 s
# with 3.6-5.8k.
DECODE_TILES_F32 = dataclasses.replace(DECODE_TILES, shrink_block_k=64, expand_block_n=64)
# The float32 prefill tiles keep two stages and one column tile a program, as their compile
# times were measured.
PREFILL_TILES_F32 = dataclasses.replace(PREFILL_TILES, shrink_block_k=32, expand_block_n=32,
                                        num_stages=2, expand_cols=1)
# A K split shorter than this reads too little per program to hide memory latency.
MIN_K_PER_SPLIT = 256
MAX_SPLIT_K = 16
# Programs per multiprocessor the shrink aims for before it starts splitting K.
PROGRAMS_PER_SM = 4
# Decode (16-row) launches of at most this many tiles load the expand's y and B tiles before
# the K-split sum: every such case of the H200 grid was as fast or faster (one adapter, the
# short lists: r16 B64 8.8 -> 8.3 us, r64 B16 11.3 -> 10.8, r64 B64 12.2 -> 11.8), while full
# lists of 64+ tiles at rank 64 were slower (r64 B256 U256 106.9 -> 121.3: the B tile held
# across the sum costs registers) (lora-grid-early-loads-4ffc093-h200.json).
EARLY_LOADS_MAX_TILES = 16


def pick_tiles(block_m: int, dtype: torch.dtype = torch.float16) -> LoraTiles:
    """The tile table entry for a step whose tile list has `block_m` rows per tile, on
    activations of `dtype`."""
    if dtype == torch.float32:
        return DECODE_TILES_F32 if block_m == DECODE_BLOCK_M else PREFILL_TILES_F32
    return DECODE_TILES if block_m == DECODE_BLOCK_M else PREFILL_TILES


def rank_block(max_rank: int) -> int:
    """Rank tile: the real rank is looped over in tiles of this size, masked at the end."""
    return min(max(16, triton.next_power_of_2(max_rank)), 64)


@lru_cache(maxsize=16)
def _num_sms(device: torch.device) -> int:
    if device.type != "cuda":
        return 4
    return torch.cuda.get_device_properties(device).multi_processor_count


def pick_split_k(programs: int, k: int, device: torch.device, max_split_k: int,
                 programs_per_sm: int = PROGRAMS_PER_SM, ratio: int = 1) -> int:
    """How many K splits the shrink needs to give every multiprocessor a few programs. The
    tiles' cap applies only once row tiles alone occupy a quarter of the multiprocessors: a
    single segment of a few dozen tokens still needs many splits to read A at full speed.
    `ratio` (`row_split_k`): rank-balanced launches, whose rank-16 rows use 1 / ratio of
    the splits, aim for ratio times the programs under ratio times the caps."""
    sms = _num_sms(device)
    want = triton.cdiv(programs_per_sm * ratio * sms, max(programs, 1))
    cap = (max_split_k if programs * 4 >= sms else MAX_SPLIT_K) * ratio
    return max(1, min(want, cap, k * ratio // MIN_K_PER_SPLIT))


def row_split_k(tiles: RowTiles, programs: int, k: int, device: torch.device,
                block_r: int) -> int:
    """The K split of a row-kernel launch of `programs` (rows x modules) work items. With
    `tiles.rank_balanced` a row of a rank-16 bucket uses block_r // 16 times fewer splits
    (`slora_kernels.lora_rows.active_splits`), so the split aims for that many times the
    programs under that many times the caps: a launch of one rank keeps its width."""
    ratio = max(1, block_r // 16) if tiles.rank_balanced else 1
    return min(tiles.max_split_k * ratio, pick_split_k(
        programs, k, device, tiles.max_split_k, tiles.programs_per_sm, ratio))


# Launches of at most this many tiles, at a rank tile of at least this, take
# `LoraTiles.wave_split`'s rule (see `pick_split`).
WAVE_SPLIT_MAX_TILES = 16
WAVE_SPLIT_MIN_RANK_TILE = 64


def pick_split(tiles: LoraTiles, num_tiles: int, num_mods: int, k: int, device: torch.device,
               block_r: int) -> int:
    """The K split a tile launch of `num_tiles` tiles (per module) and `num_mods` modules runs.

    Enough splits for PROGRAMS_PER_SM programs a multiprocessor, except that with
    `tiles.wave_split`, launches of at most WAVE_SPLIT_MAX_TILES tiles at a rank tile of at
    least WAVE_SPLIT_MIN_RANK_TILE take the largest power of two that keeps one module's tiles
    x splits within one wave (a program a multiprocessor): 16 splits on 1- and 4-tile lists
    as before, 8 on a 16-tile list (the H200 timed 8 ahead of 16 there, and 16 ahead of 8 on
    the shorter lists). The expand re-reads every split's block_r-wide partial sums once per
    column tile, so fewer splits read less; the split does not shrink with the module count,
    which multiplies the shrink's programs.
    """
    cap = split_cap(tiles, k, block_r)
    if (tiles.wave_split and num_tiles <= WAVE_SPLIT_MAX_TILES
            and block_r >= WAVE_SPLIT_MIN_RANK_TILE):
        want = triton.cdiv(_num_sms(device), max(num_tiles, 1))
        return min(cap, MAX_SPLIT_K, 1 << (want.bit_length() - 1))
    return min(cap, pick_split_k(num_tiles * num_mods, k, device, tiles.max_split_k))


def split_cap(tiles: LoraTiles, k: int, block_r: int) -> int:
    """The most K splits these tiles allow for this K and rank tile."""
    cap = min(tiles.max_split_k, max(1, k // MIN_K_PER_SPLIT))
    if tiles.split_rank_budget is not None:
        cap = min(cap, max(1, tiles.split_rank_budget // block_r))
    return cap


def add_lora_triton(
    y: torch.Tensor,
    x: torch.Tensor,
    arena: torch.Tensor,
    a_offsets: torch.Tensor,
    b_offsets: torch.Tensor,
    ranks: torch.Tensor,
    scales: torch.Tensor,
    module_ids: tuple[int, ...],
    out_slices: tuple[tuple[int, int], ...],
    meta: LoraMeta,
    *,
    max_rank: int | None = None,
    split_k: int | None = None,
    tiles: LoraTiles | RowTiles | None = None,
    pdl: bool | None = None,
) -> None:
    """y += the multi-LoRA delta of x, as `add_lora_reference` defines it.

    `max_rank` must bound every rank in the tables (the engine's `max_rank`); without it the
    launcher reads `ranks.max()`, a host sync that CUDA-graph capture forbids. `split_k` and
    `tiles` override the tuned choices (tests use them to reach every code path). A meta
    built for `ROW_BLOCK_M` runs the row kernels (`slora_kernels.lora_rows`) over its token slots.
    `pdl` overrides the tiles' programmatic dependent launch (used only where supported).
    """
    if len(module_ids) != len(out_slices):
        raise ValueError(f"{len(module_ids)} modules but {len(out_slices)} output slices")
    if meta.num_tiles == 0 or x.shape[0] == 0:
        return
    check_rows(x, y, meta)
    for group in lora_groups(x, arena, a_offsets, b_offsets, ranks, scales, module_ids,
                             out_slices, meta, max_rank=max_rank, split_k=split_k, tiles=tiles,
                             pdl=pdl):
        group.shrink()
        group.expand(y)


@dataclass
class LoraGroup:
    """One launch pair of `add_lora_triton`: up to MAX_MODULES_PER_LAUNCH modules' shrink into
    the float32 partial sums `buf`, then their expand into y. The two may run on different
    streams (the expand after the shrink); `pdl` then must be off."""

    x: torch.Tensor
    arena: torch.Tensor
    a_offsets: torch.Tensor
    b_offsets: torch.Tensor
    ranks: torch.Tensor
    scales: torch.Tensor
    mods: tuple[int, ...]
    slices: tuple[tuple[int, int], ...]
    meta: LoraMeta
    tiles: LoraTiles | RowTiles
    block_r: int
    buf: torch.Tensor
    pdl: bool
    early_loads: bool

    def shrink(self) -> None:
        t = self.tiles
        if isinstance(t, RowTiles):
            rows_shrink(self.buf, self.x, self.arena, self.a_offsets, self.ranks, self.mods,
                        self.meta.token_slots, block_r=self.block_r, tile=t.tile,
                        num_warps=t.num_warps, launch_dependents=self.pdl,
                        rank_balanced=t.rank_balanced)
            return
        lora_shrink(self.buf, self.x, self.arena, self.a_offsets, self.ranks, self.mods,
                    self.meta, block_m=t.shrink_block_m, block_r=self.block_r,
                    block_k=t.shrink_block_k, num_warps=t.num_warps, num_stages=t.num_stages,
                    rank_buckets=t.rank_buckets, launch_dependents=self.pdl)

    def expand(self, y: torch.Tensor) -> None:
        t = self.tiles
        if isinstance(t, RowTiles):
            wide = self.x.shape[0] >= t.wide_min_rows
            rows_expand(y, self.buf, self.arena, self.b_offsets, self.ranks, self.scales,
                        self.mods, self.slices, self.meta.token_slots, block_r=self.block_r,
                        block_n=t.wide_block_n if wide else t.block_n, num_warps=t.num_warps,
                        sub_tile=t.expand_sub_tile, pdl=self.pdl,
                        rank_balanced=t.rank_balanced)
            return
        lora_expand(y, self.buf, self.arena, self.b_offsets, self.ranks, self.scales, self.mods,
                    self.slices, self.meta, block_m=t.expand_block_m, block_n=t.expand_block_n,
                    block_r=self.block_r, num_warps=t.num_warps, num_stages=t.num_stages,
                    rank_buckets=t.rank_buckets, early_loads=self.early_loads, pdl=self.pdl,
                    cols=t.expand_cols)


def lora_groups(
    x: torch.Tensor,
    arena: torch.Tensor,
    a_offsets: torch.Tensor,
    b_offsets: torch.Tensor,
    ranks: torch.Tensor,
    scales: torch.Tensor,
    module_ids: tuple[int, ...],
    out_slices: tuple[tuple[int, int], ...],
    meta: LoraMeta,
    *,
    max_rank: int | None = None,
    split_k: int | None = None,
    tiles: LoraTiles | RowTiles | None = None,
    pdl: bool | None = None,
) -> list[LoraGroup]:
    """`add_lora_triton`'s launch pairs (arguments as there), each with its partial-sum buffer
    allocated, nothing launched; none for an empty step."""
    if meta.num_tiles == 0 or x.shape[0] == 0:
        return []
    if max_rank is None:
        max_rank = int(ranks.max())
    if max_rank <= 0:
        return []
    tiles = _pick_tiles(meta, tiles, x.dtype)
    if meta.tile_overrides and isinstance(tiles, LoraTiles):
        overrides: dict[str, Any] = dict(meta.tile_overrides)
        tiles = dataclasses.replace(tiles, **overrides)
    block_r = rank_block(max_rank)
    pdl = (tiles.pdl if pdl is None else pdl) and pdl_supported(x.device)
    early_loads = isinstance(tiles, LoraTiles) and (tiles.early_loads or (
        meta.block_m == DECODE_BLOCK_M and meta.num_tiles <= EARLY_LOADS_MAX_TILES))
    k = x.shape[1]
    groups = []
    for g in range(0, len(module_ids), MAX_MODULES_PER_LAUNCH):
        mods = tuple(module_ids[g : g + MAX_MODULES_PER_LAUNCH])
        slices = tuple(out_slices[g : g + MAX_MODULES_PER_LAUNCH])
        if isinstance(tiles, RowTiles):
            splits = split_k or row_split_k(tiles, x.shape[0] * len(mods), k, x.device,
                                            block_r)
        else:
            splits = split_k or pick_split(tiles, meta.split_tiles or meta.num_tiles,
                                           len(mods), k, x.device, block_r)
        buf = torch.empty((splits, x.shape[0], len(mods), max_rank), dtype=torch.float32,
                          device=x.device)
        groups.append(LoraGroup(x, arena, a_offsets, b_offsets, ranks, scales, mods, slices,
                                meta, tiles, block_r, buf, pdl, early_loads))
    return groups


def lora_forked(groups: list[LoraGroup], side: torch.cuda.Stream,
                gemm: Callable[[], torch.Tensor]) -> torch.Tensor:
    """`gemm()`, the base projection on the current stream, with the groups' shrinks on `side`
    beside it (they read only x, which the current stream wrote before), then their expands
    into its output, which is returned. The groups must have `pdl` off: an expand launched
    as a programmatic dependent would wait on the GEMM, not on its shrink."""
    main = torch.cuda.current_stream(side.device)
    side.wait_stream(main)
    with torch.cuda.stream(side):
        for g in groups:
            g.shrink()
    y = gemm()
    main.wait_stream(side)
    for g in groups:
        g.expand(y.view(-1, y.shape[-1]))
    return y


def _pick_tiles(meta: LoraMeta, tiles: LoraTiles | RowTiles | None, dtype: torch.dtype,
                ) -> LoraTiles | RowTiles:
    """The tiles a step runs: the caller's, checked against the meta's tile height, or the
    table's. A meta built for ROW_BLOCK_M runs the row kernels (RowTiles)."""
    if meta.block_m == ROW_BLOCK_M:
        if tiles is not None and not isinstance(tiles, RowTiles):
            raise ValueError("a row-kernel meta (block_m 1) takes RowTiles")
        return tiles or RowTiles()
    if isinstance(tiles, RowTiles):
        raise ValueError(f"RowTiles need a row-kernel meta, got one of {meta.block_m}-row tiles")
    tiles = tiles or pick_tiles(meta.block_m, dtype)
    if tiles.shrink_block_m != meta.block_m or tiles.expand_block_m != meta.block_m:
        raise ValueError(f"tiles of {tiles.shrink_block_m}/{tiles.expand_block_m} rows but the "
                         f"step's tile list has {meta.block_m}")
    return tiles
