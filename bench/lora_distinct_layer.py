"""One 7B decode layer's LoRA launches with many distinct adapters of mixed ranks (issue 37):
the case `bench.distinct_adapters` serves, taken apart.

64 rows on D adapters (D = 16: four rows each, sorted by adapter as the scheduler orders
them; D = 64: one each), ranks 8, 16, 32, 64 in turn on all seven modules, launches bounded at
the engine's max rank 64; and, to guard the one-rank cases, 64 rank-16 adapters and one. The four projections' LoRA (qkv, o, gate_up, down: 8 launches) run
as one decode graph runs them, CUDA-graph replayed over layers rotated past the L2, for
several launch choices:

- `tiles`: the 16-row tile list padded to the bucket's capacity (64), the K split fixed from
  that capacity (what decode graphs replay when adapters own more than two rows each);
- `rows`: the row kernels with their defaults (what decode graphs replay at one row an
  adapter), rank-balanced K splits (`RowTiles.rank_balanced`) among them;
- `rows_unbalanced`: the same K split for every rank (the default before);
  `rows_balanced_first`: the split of the first balanced version (K's cap not raised);
- `tiles_short` (one adapter): the short tile list decode graphs replay for one adapter on
  every row; `tiles_mid`: the middle list (4x the short one, from 64 rows on) they replay
  when the real tiles fit it; `tiles_bound`: the longest list a tile step can need beside the
  row kernels (slora_core.cuda_graphs.decode_tile_caps, tile_steps_max_tiles), each with its
  own K split; `tiles_graph`: the list and K split a decode graph replays for the step
  beside the row kernels (decode_split_tiles), where they leave it to the tiles, on the
  tiles' two pipeline stages; `tiles_graph_s1`, `tiles_graph_k128`, `tiles_graph_k64`: that
  list with one stage (what decode graphs launch on every tile list since
  GRAPH_TILE_STAGES), or shrink K tiles of 128 or 64 (less shared memory a shrink program);
  `tiles_graph_s1_k128`: one stage with a shrink K tile of 128 (four shrink programs a
  multiprocessor at rank bound 64, not two); `tiles_graph_s1_n128c4a`: one stage with each
  expand program covering four 128-column tiles (`LoraTiles.expand_cols`, what the
  many-adapter lists launch since MANY_TILE_OVERRIDES; lora-distinct-layer-regs-51483c3-h100.json
  also timed register caps and column tiles held by hand, removed since);
- `tiles_early`, `tiles_n128`, `tiles_early_n128`: `tiles` with the expand loading its y and B
  tiles before the K-split sum (`LoraTiles.early_loads`, which decode launches get only at
  16 tiles or fewer: a graph's padded list is 64), with 128-column expand tiles, or both;
  `tiles_n512`: 512-column expand tiles (lost at D = 4, 16 and 64 on the H100,
  lora-distinct-layer-n512-b6261c0-h100.json); `tiles_w8`, `tiles_w2`: 8 or 2 warps a
  shrink and expand program instead of 4 (both lost, lora-distinct-layer-warps-a6e5365-h100.json);
- `tiles_unpadded_split`, `tiles_unpadded`: the real tiles only (no padding to the graph's
  capacity), with the padded list's K split (what the padding's programs cost) or their own;
- `tiles@L/S`: the list padded to L tiles with the K split picked for an S-tile list, L and S
  each one of `real` (the real tiles), `mid`, `bound`, `full` (the bucket): what the list's
  padding and its split each cost, apart;
- `tiles_loop16`, `tiles_loop32` (lora-distinct-layer-expand-c337f04-h100.json, removed with
  `LoraTiles.tile_programs`, which lost): the padded list with at most 16 or 32 programs
  along it, each looping over its entries.

The first run (lora-distinct-layer-h100.json) also timed the tile list with the K split for
its real tiles or fixed at 4, 8, 16, without PDL, and the row kernels with 8 programs a
multiprocessor or 4 warps: each lost to `tiles` at D = 16 and to the balanced rows at D = 64.
The second (lora-distinct-layer-balanced-4cf2572-h100.json, where `rows_balanced` is today's
`rows` and `rows` today's `rows_unbalanced`) also timed rank-balanced tile kernels, which lost
everywhere and were taken out (slora_kernels.lora.LoraTiles says by how much).

Each is checked against float64 torch on the first layer; `base_gemms` times the layer's four
base projections (torch.mm) for scale; the bytes floor is the adapters' A and B plus x and y.

`--rows` sets the decode rows (64 by default; 256 is the batch of the middle list's run).

    python -m bench.lora_distinct_layer --out bench/results/lora-distinct-layer-h100.json
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from typing import Any

import torch

from bench.kernels_lora_grid import padded_meta
from bench.kernels_timing import DEVICE, copy_bandwidth_gbs, graph_time_us, rotation_count
from bench.run_record import add_row, run_record
from slora_core.cuda_graphs import (
    ROW_GRAPH,
    ROW_KERNELS_MAX_ROWS_PER_ADAPTER,
    decode_lora_graph,
    decode_split_tiles,
    decode_tile_caps,
    tile_steps_max_tiles,
)
from slora_kernels.lora import (
    DECODE_TILES,
    PREFILL_TILES,
    LoraGroup,
    LoraTiles,
    add_lora_triton,
    lora_forked,
    lora_groups,
    pick_split,
    rank_block,
)
from slora_kernels.lora_meta import DECODE_BLOCK_M, PREFILL_BLOCK_M, ROW_BLOCK_M, LoraMeta
from slora_kernels.lora_rows import RowTiles

RANKS = (8, 16, 32, 64)
MAX_RANK = 64
ROWS = 64
DTYPE = torch.float16


@dataclass(frozen=True)
class Shape:
    hidden: int
    inter: int

    def projections(self) -> tuple[tuple[str, tuple[int, ...], int, tuple[int, ...]], ...]:
        """(name, module ids, K, output size of each module): the layer's fused projections,
        module ids in LORA_MODULES order (q, k, v, o, gate, up, down)."""
        h, i = self.hidden, self.inter
        return (("qkv", (0, 1, 2), h, (h, h, h)), ("o", (3,), h, (h,)),
                ("gate_up", (4, 5), h, (i, i)), ("down", (6,), i, (h,)))

    def module_dims(self) -> list[tuple[int, int]]:
        """(K, N) of each of the seven modules."""
        dims: dict[int, tuple[int, int]] = {}
        for _, mods, k, outs in self.projections():
            for m, n in zip(mods, outs, strict=True):
                dims[m] = (k, n)
        return [dims[m] for m in range(7)]


SHAPES = {"llama2-7b": Shape(4096, 11008), "toy": Shape(64, 160)}


@dataclass
class Layer:
    """One rotation entry: D adapters' matrices in an arena, tables, activations."""

    arena: torch.Tensor
    a_offsets: torch.Tensor  # [D, 7] int64
    b_offsets: torch.Tensor
    ranks: torch.Tensor  # [D, 7] int32
    scales: torch.Tensor  # [D, 7] float32
    xs: list[torch.Tensor]  # per projection [ROWS, K]
    ys: list[torch.Tensor]  # per projection [ROWS, sum of outs]


def adapter_bytes(shape: Shape, adapters: int, ranks: tuple[int, ...]) -> int:
    return sum(ranks[s % len(ranks)] * (k + n) * 2 for s in range(adapters)
               for k, n in shape.module_dims())


def build_layer(shape: Shape, adapters: int, ranks: tuple[int, ...],
                gen: torch.Generator, rows: int = ROWS) -> Layer:
    dims = shape.module_dims()
    offsets: list[list[tuple[int, int]]] = []
    pos = 0
    for s in range(adapters):
        r = ranks[s % len(ranks)]
        row = []
        for k, n in dims:
            row.append((pos, pos + r * k))  # A [r, K] then B [N, r], 8-element aligned
            pos += -(-(r * k + n * r) // 8) * 8
        offsets.append(row)
    arena = torch.empty(pos, dtype=DTYPE, device=DEVICE).normal_(0, 0.02, generator=gen)
    a_off = torch.tensor([[a for a, _ in row] for row in offsets], dtype=torch.int64)
    b_off = torch.tensor([[b for _, b in row] for row in offsets], dtype=torch.int64)
    rank_t = torch.tensor([[ranks[s % len(ranks)]] * 7 for s in range(adapters)],
                          dtype=torch.int32)
    scales = torch.full((adapters, 7), 2.0, dtype=torch.float32)
    projs = shape.projections()
    return Layer(arena, a_off.to(DEVICE), b_off.to(DEVICE), rank_t.to(DEVICE), scales.to(DEVICE),
                 [torch.randn(rows, k, dtype=DTYPE, device=DEVICE, generator=gen)
                  for _, _, k, _ in projs],
                 [torch.randn(rows, sum(outs), dtype=DTYPE, device=DEVICE, generator=gen)
                  for _, _, _, outs in projs])


Choice = tuple[LoraMeta, LoraTiles | RowTiles, Callable[[int, int], int | None]]


def choices(slots: list[int]) -> dict[str, Choice]:
    """name -> (meta, tiles, split for (modules, K) or None for the launcher's own); one
    decode row a slot."""
    rows_n = len(slots)
    grph = padded_meta(slots, rows_n)
    real_meta = LoraMeta.from_token_slots(slots, device=DEVICE, block_m=DECODE_BLOCK_M)
    real = real_meta.num_tiles
    rows = LoraMeta.from_token_slots(slots, device=DEVICE, block_m=ROW_BLOCK_M)

    def none(_m: int, _k: int) -> int | None:
        return None

    def split_for(n: int) -> Callable[[int, int], int | None]:
        """The K split decode launches pick for an n-tile list."""
        return lambda m, k: pick_split(DECODE_TILES, n, m, k, torch.device(DEVICE),
                                       rank_block(MAX_RANK))

    def first_balanced(_m: int, k: int) -> int | None:
        # The first rank-balanced rule (lora-distinct-layer-h100.json @ 017c9b7): split caps x4 but
        # K's cap not, so 16 splits at K 4096 and 33 at 11008.
        return min(33, k // 256)

    out: dict[str, Choice] = {
        "tiles": (grph, DECODE_TILES, none),
        # The expand's y and B tiles loaded before its K-split sum: decode launches get it
        # only at <= EARLY_LOADS_MAX_TILES tiles, and a graph's padded list (64 at 64 rows)
        # is longer, though at D = 16 only 16 of its tiles are real.
        "tiles_early": (grph, dataclasses.replace(DECODE_TILES, early_loads=True), none),
        # Narrower expand column tiles: twice the programs, half the B and y a program.
        "tiles_n128": (grph, dataclasses.replace(DECODE_TILES, expand_block_n=128), none),
        # Wider expand column tiles: half the programs, each reading twice the B and y (at
        # D = 16 an expand program's B tile is 4-32 KB at 256 columns). Lost everywhere on
        # the H100: D = 4, 16, 64: 63.0, 87.8, 219.5 -> 70.5, 95.0, 226.9 us.
        "tiles_n512": (grph, dataclasses.replace(DECODE_TILES, expand_block_n=512), none),
        # 8 or 2 warps a shrink and expand program instead of 4: at rank 64 a 4-warp expand
        # program holds its 64 x 256 B tile in float32, 128 registers a thread. Both lost on
        # the H100 (lora-distinct-layer-warps-a6e5365-h100.json): D = 4, 16, 64: 61.8, 87.3,
        # 217.6 us with 4 warps; 73.6, 116.6, 289.4 with 8; 83.1, 104.4, 231.9 with 2.
        "tiles_w8": (grph, dataclasses.replace(DECODE_TILES, num_warps=8), none),
        "tiles_w2": (grph, dataclasses.replace(DECODE_TILES, num_warps=2), none),
        "tiles_early_n128": (grph, dataclasses.replace(DECODE_TILES, early_loads=True,
                                                       expand_block_n=128), none),
        # The real tiles only (a graph pads its list to its capacity, 64 at 64 rows: at
        # D = 16, 48 of every launch's tile programs exit at once): with the split the
        # padded list gets and with its own. 16 real tiles or fewer take the early loads,
        # so the padding's cost is tiles_unpadded_split against tiles_early.
        "tiles_unpadded_split": (real_meta, DECODE_TILES, split_for(grph.num_tiles)),
        "tiles_unpadded": (real_meta, DECODE_TILES, none),
        "rows": (rows, RowTiles(), none),
        "rows_unbalanced": (rows, RowTiles(rank_balanced=False), none),
        "rows_balanced_first": (rows, RowTiles(rank_balanced=True), first_balanced),
    }
    # The decode graphs' lists shorter than the bucket's (decode_tile_caps): the short one
    # (one adapter) and the middle one, each where the real tiles fit it, and with the row
    # kernels on, the longest list a tile step can need.
    caps = decode_tile_caps(rows_n, None)
    short = caps[-1]
    if real <= short:
        out["tiles_short"] = (padded_meta(slots, short), DECODE_TILES, none)
    if len(caps) == 3 and short < real <= caps[1]:
        out["tiles_mid"] = (padded_meta(slots, caps[1]), DECODE_TILES, none)
    bound = tile_steps_max_tiles(rows_n, ROW_KERNELS_MAX_ROWS_PER_ADAPTER)
    if real <= bound < rows_n:
        out["tiles_bound"] = (padded_meta(slots, bound), DECODE_TILES, none)
    # What a decode graph replays for this step beside the row kernels (where they leave it
    # to the tiles): the shortest list the real tiles fit, with its split.
    length = decode_lora_graph(rows_n, real, rows_n, real_meta.num_segments,
                               ROW_KERNELS_MAX_ROWS_PER_ADAPTER)
    if length != ROW_GRAPH:
        split_n = decode_split_tiles(rows_n, length, ROW_KERNELS_MAX_ROWS_PER_ADAPTER)
        graph_meta = dataclasses.replace(padded_meta(slots, length), split_tiles=split_n)
        out["tiles_graph"] = (graph_meta, DECODE_TILES, none)
        # The same with lighter shrink programs, for the fork (--with-base): a shrink program
        # stages its x and A tiles in shared memory (16 x 256 and 256 x 64 fp16, twice with
        # 2 stages: ~80 KB), which a GEMM's resident blocks may leave no room for, so that the
        # forked shrinks wait for the GEMM's blocks to retire. One stage or a K tile of 128
        # or 64 halves or quarters that.
        one = dataclasses.replace(DECODE_TILES, num_stages=1)
        out["tiles_graph_s1"] = (graph_meta, one, none)
        for bk in (128, 64):
            out[f"tiles_graph_k{bk}"] = (
                graph_meta, dataclasses.replace(DECODE_TILES, shrink_block_k=bk), none)
        # One stage with more programs resident a multiprocessor: at rank bound 64 ptxas
        # gives the shrink 253 registers a thread (two 4-warp programs a multiprocessor), a
        # shrink K tile of 128 needs 126 (four); and expand programs covering four 128-column
        # tiles in turn through the compiler's pipeline (LoraTiles.expand_cols: the entry's
        # chain of dependent loads and the K-split sum once a program; what decode graphs'
        # many-adapter lists launch since MANY_TILE_OVERRIDES). At 51483c3 the K tile gained
        # nothing and the column tiles won at 16 adapters
        # (lora-distinct-layer-regs-51483c3-h100.json); the register caps (168, 128) and the
        # column tiles held in registers by hand (two of 256, four of 128) lost and were
        # removed after f979e18.
        out["tiles_graph_s1_k128"] = (graph_meta, dataclasses.replace(one, shrink_block_k=128),
                                      none)
        out["tiles_graph_s1_n128c4a"] = (graph_meta, dataclasses.replace(
            one, expand_block_n=128, expand_cols=4), none)
    # tiles@L/S: the list padded to L tiles, the K split picked as for an S-tile list, L and
    # S each the real tiles, the middle list, the bound or the bucket (where the real fit).
    lengths = {"real": real, "mid": caps[1] if len(caps) == 3 else 0, "bound": bound,
               "full": rows_n}
    for lname, length in lengths.items():
        for sname, as_for in lengths.items():
            if real <= length and real <= as_for:
                out[f"tiles@{lname}/{sname}"] = (padded_meta(slots, length), DECODE_TILES,
                                                 split_for(as_for))
    return out


MixedChoice = list[Choice]  # launches one after another, each over its own meta


def mixed_choices(slots: list[int], decode_rows: int) -> dict[str, MixedChoice]:
    """A mixed step: `decode_rows` one-row decode segments, then a prompt chunk. What mixed
    graphs run on steps of more than SHORT_TILES_MAX_TOKENS tokens (64-row tiles over every
    segment, the tile list padded to the graph's capacity, K split from it), the same with
    more K splits or with one or two pipeline stages instead of the tiles' three (`_s1`,
    `_s2`: two before PREFILL_STAGES), 16-row tiles over every segment (what steps of at most
    SHORT_TILES_MAX_TOKENS tokens run; `_s1`, `_s3`: one or three stages instead of the
    tiles' two), and two launch sets: the row kernels over the decode rows and 64-row tiles
    over the chunk."""
    t = len(slots)
    real = LoraMeta.from_token_slots(slots, device=DEVICE, block_m=PREFILL_BLOCK_M).num_tiles
    cap = -(-t // PREFILL_BLOCK_M) + min(decode_rows, t)  # MixedGraphs' capacity for t tokens
    graph = padded_meta(slots, max(cap, real), PREFILL_BLOCK_M)
    dec16 = LoraMeta.from_token_slots(slots, device=DEVICE, block_m=DECODE_BLOCK_M)
    rows = LoraMeta.from_token_slots(slots[:decode_rows] + [-1] * (t - decode_rows),
                                     device=DEVICE, block_m=ROW_BLOCK_M)
    chunk = LoraMeta.from_token_slots([-1] * decode_rows + slots[decode_rows:], device=DEVICE,
                                      block_m=PREFILL_BLOCK_M)

    def none(_m: int, _k: int) -> int | None:
        return None

    def fixed(n: int) -> Callable[[int, int], int | None]:
        return lambda _m, _k: n

    wide = dataclasses.replace(PREFILL_TILES, max_split_k=16)
    return {
        "mixed_tiles64": [(graph, PREFILL_TILES, none)],
        "mixed_tiles64_split8": [(graph, wide, fixed(8))],
        "mixed_tiles64_split16": [(graph, wide, fixed(16))],
        "mixed_tiles64_s1": [(graph, dataclasses.replace(PREFILL_TILES, num_stages=1), none)],
        "mixed_tiles64_s2": [(graph, dataclasses.replace(PREFILL_TILES, num_stages=2), none)],
        # One 128-column tile an expand program, as before PREFILL_TILES took four (the K
        # splits' partial sums then re-read once a column tile). At f770983 four won in every
        # case; two, and eight of 64 columns, lost to four by 3-8% and were removed
        # (lora-distinct-layer-mixed-cols-f770983-h100.json).
        "mixed_tiles64_c1": [(graph, dataclasses.replace(PREFILL_TILES, expand_cols=1), none)],
        "mixed_tiles16": [(dec16, DECODE_TILES, none)],
        "mixed_tiles16_s1": [(dec16, dataclasses.replace(DECODE_TILES, num_stages=1), none)],
        "mixed_tiles16_s3": [(dec16, dataclasses.replace(DECODE_TILES, num_stages=3), none)],
        "mixed_rows_and_chunk_tiles": [(rows, RowTiles(), none), (chunk, PREFILL_TILES, none)],
    }


def layer_calls(lay: Layer, shape: Shape, choice: Choice | MixedChoice) -> Callable[[], None]:
    launches = choice if isinstance(choice, list) else [choice]
    projs = shape.projections()

    def run() -> None:
        for (_, mods, k, outs), x, y in zip(projs, lay.xs, lay.ys, strict=True):
            starts = [sum(outs[:i]) for i in range(len(outs))]
            for meta, tiles, split in launches:
                add_lora_triton(y, x, lay.arena, lay.a_offsets, lay.b_offsets, lay.ranks,
                                lay.scales, mods, tuple(zip(starts, outs, strict=True)), meta,
                                max_rank=MAX_RANK, split_k=split(len(mods), k), tiles=tiles)

    return run


def rel_err_f64(lay: Layer, shape: Shape, slots: list[int], run: Callable[[], None]) -> float:
    """One call's delta (all four projections) against float64 torch."""
    for y in lay.ys:
        y.normal_()
    before = [y.double() for y in lay.ys]
    run()
    num = den = 0.0
    for (_, mods, k, outs), x, y, y0 in zip(shape.projections(), lay.xs, lay.ys, before,
                                            strict=True):
        ref = torch.zeros_like(y0)
        col = 0
        idx = torch.tensor(slots, device=y.device)
        for m, n in zip(mods, outs, strict=True):
            for s in sorted(set(slots)):
                rows = idx == s
                r = int(lay.ranks[s, m])
                a = lay.arena[int(lay.a_offsets[s, m]):][: r * k].view(r, k).double()
                b = lay.arena[int(lay.b_offsets[s, m]):][: n * r].view(n, r).double()
                ref[rows, col : col + n] = ((x[rows].double() @ a.T) @ b.T
                                            * float(lay.scales[s, m]))
            col += n
        num += float(((y.double() - y0) - ref).norm() ** 2)
        den += float(ref.norm() ** 2)
    return (num / den) ** 0.5


def base_gemms(shape: Shape, gen: torch.Generator, rows: int = ROWS) -> Callable[[], None]:
    ws = [torch.randn(sum(outs), k, dtype=DTYPE, device=DEVICE, generator=gen) * 0.02
          for _, _, k, outs in shape.projections()]
    xs = [torch.randn(rows, k, dtype=DTYPE, device=DEVICE, generator=gen)
          for _, _, k, _ in shape.projections()]

    def run() -> None:
        for x, w in zip(xs, ws, strict=True):
            torch.mm(x, w.T)

    return run


def base_weights(shape: Shape, gen: torch.Generator) -> list[torch.Tensor]:
    """The four projections' base weights [out, K], shared by every rotated layer: 405 MB at
    7B, far past the L2, so every call streams them from memory as a layer does."""
    return [torch.randn(sum(outs), k, dtype=DTYPE, device=DEVICE, generator=gen) * 0.02
            for _, _, k, outs in shape.projections()]


def with_base_calls(lay: Layer, shape: Shape, choice: Choice | None, ws: list[torch.Tensor],
                    side: torch.cuda.Stream | None) -> Callable[[], None]:
    """Each projection's base GEMM written into y, then (with a choice) its LoRA: in line
    after the GEMM (side None), or with the shrinks on the `side` stream beside the GEMM
    (they read only x) and the expands after both, launched plainly (a programmatic
    dependent launch needs its producer on the same stream)."""
    groups: list[list[LoraGroup]] = []
    for (_, mods, k, outs), x in zip(shape.projections(), lay.xs, strict=True):
        if choice is None:
            groups.append([])
            continue
        meta, tiles, split = choice
        starts = [sum(outs[:i]) for i in range(len(outs))]
        groups.append(lora_groups(
            x, lay.arena, lay.a_offsets, lay.b_offsets, lay.ranks, lay.scales, mods,
            tuple(zip(starts, outs, strict=True)), meta, max_rank=MAX_RANK,
            split_k=split(len(mods), k), tiles=tiles, pdl=False if side is not None else None))

    def run() -> None:
        for x, y, w, gs in zip(lay.xs, lay.ys, ws, groups, strict=True):
            if side is None:
                torch.mm(x, w.T, out=y)
                for g in gs:
                    g.shrink()
                    g.expand(y)
                continue
            lora_forked(gs, side, partial(torch.mm, x, w.T, out=y))

    return run


def time_with_base(layers: list[Layer], shape: Shape, name: str, choice: Choice,
                   ws: list[torch.Tensor], row: dict[str, Any]) -> None:
    """`--with-base`: the layer's base GEMMs alone (once a case), with `name`'s LoRA in line,
    and with its shrinks forked beside them (on a stream of default and of high priority);
    whether the fork's y is the in-line one's bit for bit (the same kernels and splits on the
    same inputs). On the CPU, where there are no streams, the fork arms run in line."""
    side = torch.cuda.Stream() if DEVICE == "cuda" else None
    if "base_layer_us" not in row:
        row["base_layer_us"] = graph_time_us(
            [with_base_calls(lay, shape, None, ws, None) for lay in layers], replays=10)
    row[f"{name}+base_us"] = graph_time_us(
        [with_base_calls(lay, shape, choice, ws, None) for lay in layers], replays=10)
    row[f"{name}+base_fork_us"] = graph_time_us(
        [with_base_calls(lay, shape, choice, ws, side) for lay in layers], replays=10)
    # The side stream at CUDA's highest priority: the shrinks' programs dispatched ahead of
    # the GEMM's waiting ones (tied the plain stream on the H100,
    # lora-distinct-layer-fork-b02a099-h100.json).
    high = torch.cuda.Stream(priority=-1) if DEVICE == "cuda" else None
    row[f"{name}+base_fork_high_us"] = graph_time_us(
        [with_base_calls(lay, shape, choice, ws, high) for lay in layers], replays=10)
    inline = with_base_calls(layers[0], shape, choice, ws, None)
    fork = with_base_calls(layers[0], shape, choice, ws, side)
    inline()
    want = [y.clone() for y in layers[0].ys]
    fork()
    if DEVICE == "cuda":
        torch.cuda.synchronize()
    row[f"{name}_fork_matches"] = all(torch.equal(a, b) for a, b in zip(
        want, layers[0].ys, strict=True))


def parse_cases(text: str) -> list[tuple[int, tuple[int, ...], int]]:
    """`--cases`: D:RANKS[:chunkN],... -> (adapters, ranks, prompt chunk tokens or 0)."""
    cases = []
    for c in text.split(","):
        if c.count(":") not in (1, 2):
            raise ValueError(f"{c!r}: cases are D:RANKS or D:RANKS:chunkN")
        d, rs, *mixed = c.split(":")
        if len(mixed) > 1 or (mixed and not mixed[0].startswith("chunk")):
            raise ValueError(f"{c!r}: the third field is chunkN")
        chunk = int(mixed[0].removeprefix("chunk")) if mixed else 0
        ranks = tuple(int(r) for r in rs.split("-"))
        if int(d) < (2 if chunk else 1) or chunk < 0 or not all(0 < r <= MAX_RANK
                                                                 for r in ranks):
            raise ValueError(f"{c!r}: at least 1 adapter (2 with a chunk), ranks in "
                             f"1..{MAX_RANK}")
        cases.append((int(d), ranks, chunk))
    return cases


# The names `choices` and `mixed_choices` give their launch choices (`tiles_short` only where
# one adapter's tiles fit the short list), for checking --choices before anything is built.
CHOICE_NAMES = ("tiles", "tiles_early", "tiles_n128", "tiles_n512", "tiles_w8", "tiles_w2",
                "tiles_early_n128", "tiles_unpadded_split", "tiles_unpadded", "rows",
                "rows_unbalanced", "rows_balanced_first", "tiles_short", "tiles_mid",
                "tiles_bound", "tiles_graph", "tiles_graph_s1", "tiles_graph_k128",
                "tiles_graph_k64", "tiles_graph_s1_k128", "tiles_graph_s1_n128c4a")
SIZES = ("real", "mid", "bound", "full")  # the tile-list lengths of tiles@L/S
MIXED_CHOICE_NAMES = ("mixed_tiles64", "mixed_tiles64_split8", "mixed_tiles64_split16",
                      "mixed_tiles64_s1", "mixed_tiles64_s2", "mixed_tiles64_c1", "mixed_tiles16",
                      "mixed_tiles16_s1", "mixed_tiles16_s3", "mixed_rows_and_chunk_tiles")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--shape", default="llama2-7b" if DEVICE == "cuda" else "toy",
                    choices=sorted(SHAPES))
    ap.add_argument("--cases", default="16:8-16-32-64,64:8-16-32-64,64:16,1:16",
                    help="D:RANKS[:chunkN] cases: D distinct adapters, ranks in turn (all in "
                         "launches bounded at rank 64); with chunkN a mixed step: 64 decode "
                         "rows on D-1 adapters and an N-token prompt chunk on the last")
    ap.add_argument("--choices", default=None, help="comma-separated subset of the choices")
    ap.add_argument("--rows", type=int, default=ROWS,
                    help="decode rows (a decode graph's bucket), at least every case's D: "
                         "rows are dealt to adapters in order, rows / D each (rounded)")
    ap.add_argument("--with-base", action="store_true",
                    help="also time each chosen choice with the layer's base GEMMs, its LoRA "
                         "in line after each GEMM and with its shrinks forked beside it on a "
                         "second stream (decode cases only)")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    try:
        cases = parse_cases(args.cases)
    except ValueError as e:
        ap.error(f"--cases {args.cases!r}: {e}")
    n_rows = args.rows
    if any(n_rows < (d - 1 if chunk else d) for d, _, chunk in cases):
        ap.error(f"--rows {n_rows}: at least every case's adapter count (less one with a "
                 "chunk)")
    names = set(args.choices.split(",")) if args.choices else None
    known = {n for _, _, chunk in cases for n in (MIXED_CHOICE_NAMES if chunk else CHOICE_NAMES)}
    known |= {f"tiles@{a}/{b}" for a in SIZES for b in SIZES}
    if names is not None and not names <= known:
        ap.error(f"--choices: unknown {', '.join(sorted(names - known))} (choose from "
                 f"{', '.join(sorted(known))})")
    shape = SHAPES[args.shape]
    gen = torch.Generator(device=DEVICE).manual_seed(0)
    ws = base_weights(shape, gen) if args.with_base else []
    per_call = adapter_bytes(shape, 16, RANKS) + n_rows * 2 * sum(
        k + 2 * sum(outs) for _, _, k, outs in shape.projections())
    copy = copy_bandwidth_gbs(min(256 << 20, per_call)) if DEVICE == "cuda" else {
        "kernel": 1.0, "memcpy": 1.0}
    result: dict[str, Any] = run_record(["bench.lora_distinct_layer", *(argv or sys.argv[1:])])
    result |= {"shape": args.shape, "rows": n_rows, "ranks": RANKS, "max_rank": MAX_RANK,
               "copy_gbs": copy}
    rows: list[dict[str, Any]] = []
    result["rows_out"] = rows
    result["base_gemms_us"] = graph_time_us([base_gemms(shape, gen, n_rows)], replays=10)
    for d, ranks, chunk in cases:
        if chunk:  # n_rows decode rows on adapters 0..d-2, a prompt chunk on adapter d-1
            slots = [i * (d - 1) // n_rows for i in range(n_rows)] + [d - 1] * chunk
        else:  # grouped by adapter, n_rows // d each
            slots = [i * d // n_rows for i in range(n_rows)]
        t = len(slots)
        io = t * 2 * sum(k + 2 * sum(outs) for _, _, k, outs in shape.projections())
        floor_bytes = adapter_bytes(shape, d, ranks) + io
        count = rotation_count(floor_bytes) if DEVICE == "cuda" else 1  # CPU: a smoke run
        layers = [build_layer(shape, d, ranks, gen, t) for _ in range(count)]
        row: dict[str, Any] = {"adapters": d, "ranks": ranks, "prompt_chunk": chunk,
                               "rows_per_adapter": n_rows / (d - 1 if chunk else d),
                               "layers_rotated": len(layers), "floor_bytes": floor_bytes,
                               "floor_us": floor_bytes / (copy["kernel"] * 1e3)}
        cands: dict[str, Choice | MixedChoice] = (
            dict(mixed_choices(slots, n_rows)) if chunk else dict(choices(slots)))
        for name, choice in cands.items():
            if names is not None and name not in names:
                continue
            row[f"{name}_us"] = graph_time_us([layer_calls(lay, shape, choice)
                                               for lay in layers], replays=10)
            row[f"{name}_rel_err"] = rel_err_f64(layers[0], shape, slots,
                                                 layer_calls(layers[0], shape, choice))
            if args.with_base and not isinstance(choice, list):
                time_with_base(layers, shape, name, choice, ws, row)
        add_row(args.out, result, rows, row, len(cases))
        del layers
        if DEVICE == "cuda":
            torch.cuda.empty_cache()
    print(f"base GEMMs {result['base_gemms_us']:.1f} us a layer")
    for row in rows:
        timed = sorted((v, k[:-3]) for k, v in row.items() if k.endswith("_us")
                       and k != "floor_us")
        print(f"D={row['adapters']:3d} r{row['ranks']} chunk {row['prompt_chunk']} "
              f"floor {row['floor_us']:6.1f} us | "
              + "  ".join(f"{n} {v:.1f}" for v, n in timed))
    return 0


if __name__ == "__main__":
    sys.exit(main())
