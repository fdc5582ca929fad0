"""What riding the base GEMM would save with many distinct adapters (issue 37), before anyone
builds it: one 7B decode layer's four projections, 64 rows on D adapters, ranks 8-64 on all
seven modules, merge off.

The sole-adapter ride (slora_core/lora_ride.py) appends one adapter's A rows to each base
weight, so the base GEMM also writes the shrink x @ A.T. With D adapters in the batch the same
GEMM could carry all D adapters' A rows: every token is multiplied by every adapter's A (wasted
multiply-adds, but a decode GEMM is bound by bytes, and each A is read once either way), and
the expand then reads, for each token, its own adapter's columns. This times, per layer:

- `base`: the four base GEMMs (torch.mm), the floor;
- `kernels`: base + the LoRA launches decode graphs run today (16-row tiles over a padded tile
  list where adapters own more than two rows, the row kernels otherwise; shrink then expand,
  as `add_lora_triton` picks them);
- `wide_gemm`: the GEMMs over [W; every adapter's A] alone: what the shrink costs inside them;
- `many_ride`: the wide GEMMs, a gather of each token's own shrink columns into the expand's
  float32 buffer (torch.gather and a copy: 2 launches a projection, an upper bound on what a
  fused expand reading the wide output would take), then today's expand over that buffer.

Each variant's y is checked against float64 torch (x @ W.T plus every token's delta) on the
first layer. Not measured here: in an engine the appended rows would be rewritten when the
batch's adapter set changes (a copy of the new adapters' A rows), and the wide GEMM's width
varies with the set (graphs keyed by it), as the ride's graphs are keyed by its row count.

    python -m bench.lora_many_ride --out bench/results/lora-many-ride-h100.json
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from bench.kernels_lora_grid import padded_meta
from bench.kernels_timing import DEVICE, graph_time_us, rotation_count
from bench.lora_distinct_layer import (
    DTYPE,
    MAX_RANK,
    RANKS,
    ROWS,
    SHAPES,
    Layer,
    Shape,
    build_layer,
)
from bench.run_record import add_row, run_record
from slora_kernels.lora import DECODE_TILES, LoraTiles, add_lora_triton, rank_block
from slora_kernels.lora_expand import lora_expand
from slora_kernels.lora_meta import ROW_BLOCK_M, LoraMeta
from slora_kernels.lora_rows import RowTiles, rows_expand

VARIANTS = ("base", "kernels", "wide_gemm", "many_ride")


@dataclass
class Projection:
    """One projection of one layer: its base weight, the weight with every adapter's A rows
    appended, the wide output, and the gather that picks each token's shrink columns."""

    mods: tuple[int, ...]
    slices: tuple[tuple[int, int], ...]
    x: torch.Tensor        # [T, K]
    w: torch.Tensor        # [N, K]
    w_wide: torch.Tensor   # [N + extra, K]
    y_wide: torch.Tensor   # [T, N + extra]; y is its first N columns
    index: torch.Tensor    # [T, mods * MAX_RANK] int64: y_wide columns of each token's shrink
    picked: torch.Tensor   # [T, mods * MAX_RANK] the gather's output (fp16)
    buf: torch.Tensor      # [1, T, mods, MAX_RANK] float32, the expand's input


def build(shape: Shape, lay: Layer, slots: list[int], gen: torch.Generator) -> list[Projection]:
    """The layer's projections for the batch `slots` (token -> adapter), adapters' A rows
    appended in the order of first appearance."""
    order = list(dict.fromkeys(slots))
    t = len(slots)
    out = []
    for (_, mods, k, outs), x in zip(shape.projections(), lay.xs, strict=True):
        n = sum(outs)
        w = torch.randn(n, k, dtype=DTYPE, device=DEVICE, generator=gen) * k ** -0.5
        rows, col = [], {}
        at = n
        for s in order:
            for i, m in enumerate(mods):
                r = int(lay.ranks[s, m])
                a0 = int(lay.a_offsets[s, m])
                rows.append(lay.arena[a0 : a0 + r * k].view(r, k))
                col[(s, i)] = at
                at += r
        index = torch.empty(t, len(mods), MAX_RANK, dtype=torch.int64)
        for tok, s in enumerate(slots):
            for i in range(len(mods)):
                # Columns past the adapter's rank point at its first one: the expand reads
                # only the first `rank` of each module's MAX_RANK.
                r = int(lay.ranks[s, mods[i]])
                index[tok, i] = col[(s, i)] + torch.arange(MAX_RANK).clamp(max=r - 1)
        starts = [sum(outs[:i]) for i in range(len(outs))]
        out.append(Projection(
            mods=mods, slices=tuple(zip(starts, outs, strict=True)), x=x, w=w,
            w_wide=torch.cat([w, *rows]),
            y_wide=torch.empty(t, at, dtype=DTYPE, device=DEVICE),
            index=index.view(t, -1).to(DEVICE),
            picked=torch.empty(t, len(mods) * MAX_RANK, dtype=DTYPE, device=DEVICE),
            buf=torch.empty(1, t, len(mods), MAX_RANK, dtype=torch.float32, device=DEVICE)))
    return out


def decode_meta(slots: list[int]) -> tuple[LoraMeta, LoraTiles | RowTiles]:
    """What a decode graph replays for this batch: the row kernels at one or two rows an
    adapter, else 16-row tiles over the tile list padded to the batch's capacity."""
    per_adapter = len(slots) // len(set(slots))
    if per_adapter <= 2:
        return LoraMeta.from_token_slots(slots, device=DEVICE, block_m=ROW_BLOCK_M), RowTiles()
    return padded_meta(slots, len(slots)), DECODE_TILES


def variant(name: str, lay: Layer, projs: list[Projection], meta: LoraMeta,
            tiles: LoraTiles | RowTiles) -> Callable[[], list[torch.Tensor]]:
    """A call computing the layer's four y the way `name` does; returns them."""
    block_r = rank_block(MAX_RANK)

    def run() -> list[torch.Tensor]:
        ys = []
        for p in projs:
            n = p.w.shape[0]
            if name in ("base", "kernels"):
                y = torch.mm(p.x, p.w.t(), out=p.y_wide[:, :n])
                if name == "kernels":
                    add_lora_triton(y, p.x, lay.arena, lay.a_offsets, lay.b_offsets, lay.ranks,
                                    lay.scales, p.mods, p.slices, meta, max_rank=MAX_RANK,
                                    tiles=tiles)
                ys.append(y)
                continue
            torch.mm(p.x, p.w_wide.t(), out=p.y_wide)
            y = p.y_wide[:, :n]
            if name == "many_ride":
                torch.gather(p.y_wide, 1, p.index, out=p.picked)
                p.buf.copy_(p.picked.view(p.buf.shape))
                if isinstance(tiles, RowTiles):
                    rows_expand(y, p.buf, lay.arena, lay.b_offsets, lay.ranks, lay.scales,
                                p.mods, p.slices, meta.token_slots, block_r=block_r,
                                block_n=(tiles.wide_block_n if y.shape[0] >= tiles.wide_min_rows
                                         else tiles.block_n),
                                num_warps=tiles.num_warps, sub_tile=tiles.expand_sub_tile,
                                rank_balanced=tiles.rank_balanced)
                else:
                    lora_expand(y, p.buf, lay.arena, lay.b_offsets, lay.ranks, lay.scales,
                                p.mods, p.slices, meta, block_m=tiles.expand_block_m,
                                block_n=tiles.expand_block_n, block_r=block_r,
                                num_warps=tiles.num_warps, num_stages=tiles.num_stages,
                                rank_buckets=tiles.rank_buckets)
            ys.append(y)
        return ys

    return run


def rel_err(lay: Layer, projs: list[Projection], slots: list[int], ys: list[torch.Tensor],
            delta: bool) -> float:
    """The four outputs against float64 torch: x @ W.T, plus each token's delta if `delta`."""
    num = den = 0.0
    idx = torch.tensor(slots, device=DEVICE)
    for p, y in zip(projs, ys, strict=True):
        k = p.x.shape[1]
        ref = p.x.double() @ p.w.double().T
        if delta:
            for m, (start, n) in zip(p.mods, p.slices, strict=True):
                for s in sorted(set(slots)):
                    rows = idx == s
                    r = int(lay.ranks[s, m])
                    a = lay.arena[int(lay.a_offsets[s, m]):][: r * k].view(r, k).double()
                    b = lay.arena[int(lay.b_offsets[s, m]):][: n * r].view(n, r).double()
                    ref[rows, start : start + n] += ((p.x[rows].double() @ a.T) @ b.T
                                                     * float(lay.scales[s, m]))
        num += float((y.double() - ref).norm() ** 2)
        den += float(ref.norm() ** 2)
    return (num / den) ** 0.5


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--shape", default="llama2-7b" if DEVICE == "cuda" else "toy",
                    choices=sorted(SHAPES))
    ap.add_argument("--adapters", default="16,64",
                    help="comma-separated D: distinct adapters over the 64 rows")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    shape = SHAPES[args.shape]
    cases = [int(d) for d in args.adapters.split(",")]
    if not all(0 < d <= ROWS and ROWS % d == 0 for d in cases):
        ap.error(f"--adapters {args.adapters!r}: each D must divide {ROWS}")
    gen = torch.Generator(device=DEVICE).manual_seed(0)
    result: dict[str, Any] = run_record(["bench.lora_many_ride", *(argv or sys.argv[1:])])
    result |= {"shape": args.shape, "rows": ROWS, "ranks": RANKS, "max_rank": MAX_RANK,
               "method": "*_us: one layer's four projections, median of 10 CUDA-graph "
               "replays over layers rotated past the L2; rel_err: against float64 torch"}
    rows: list[dict[str, Any]] = []
    result["rows_out"] = rows
    weights = sum(sum(outs) * k * 2 for _, _, k, outs in shape.projections())
    for d in cases:
        slots = [i * d // ROWS for i in range(ROWS)]  # grouped by adapter, ROWS // d each
        # At least two layers: a layer's base weights alone outsize the L2, its adapters not.
        count = max(2, rotation_count(weights)) if DEVICE == "cuda" else 1
        layers = []
        for _ in range(count):
            lay = build_layer(shape, d, RANKS, gen)
            layers.append((lay, build(shape, lay, slots, gen)))
        meta, tiles = decode_meta(slots)
        row: dict[str, Any] = {"adapters": d, "rows_per_adapter": ROWS // d,
                               "lora_path": "rows" if isinstance(tiles, RowTiles) else "tiles",
                               "layers_rotated": count,
                               "extra_gemm_rows": {str(p.mods): p.w_wide.shape[0] - p.w.shape[0]
                                                   for p in layers[0][1]}}
        for name in VARIANTS:
            row[f"{name}_us"] = graph_time_us(
                [variant(name, lay, projs, meta, tiles) for lay, projs in layers], replays=10)
            if name != "wide_gemm":
                lay, projs = layers[0]
                ys = variant(name, lay, projs, meta, tiles)()
                row[f"{name}_rel_err"] = rel_err(lay, projs, slots, ys, name != "base")
        for name in VARIANTS[1:]:
            row[f"{name}_added_us"] = row[f"{name}_us"] - row["base_us"]
        add_row(args.out, result, rows, row, len(cases))
        del layers
        if DEVICE == "cuda":
            torch.cuda.empty_cache()
    for row in rows:
        print(f"D={row['adapters']:3d} ({row['lora_path']}) base {row['base_us']:.1f} us | "
              + "  ".join(f"{n} +{row[f'{n}_added_us']:.1f}" for n in VARIANTS[1:]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
