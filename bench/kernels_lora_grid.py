"""Decode LoRA over the issue's grid, the way the engine's CUDA graphs run it, by graph replay.

r in {8, 16, 64} x B in {1, 16, 64, 256} rows x U in {1, B/4, B} adapters, rows grouped by
adapter (as the scheduler orders them) and in random order; one 4096x4096 module, fp16. Each
case times, over inputs rotated past the L2:

- `graph_capture_split`: the tile list padded to the bucket's capacity (B), the K split fixed
  at capture from that capacity (decode graphs' full list); rows in random order are sorted
  by adapter into one segment each (`LoraMeta.token_rows`);
- `graph_short_list` (when the real tiles fit cdiv(B, 16)): the short list decode graphs also
  capture for one adapter on every row, split fixed from its capacity;
- `exact`: the real tile list, split chosen on the host (an eager step);
- `early_loads`: `graph_capture_split` with the expand loading its y and B tiles before it sums
  the K splits (`LoraTiles.early_loads`; launches of at most 16 tiles, the short lists among
  them, always do);
- `pdl` / `no_pdl` suffixes: the variant with the expand launched as a programmatic
  dependent of its shrink (`LoraTiles.pdl`, `RowTiles.pdl`) and without, whatever the
  default (`graph_pdl`, `short_list_pdl`, `rows_pdl`, ...);
- `wide_split4` (U >= B/4): 512-wide expand and shrink tiles, K split at most 4;
- `budget256` (r 64): split capped at 256 // rank tile (fewer partial sums to add);
- `graph_wave` / `short_list_wave`: the K split of `LoraTiles.wave_split` (launches of at
  most 16 tiles: one wave of tiles x splits, a power of two); the default since 015e6a7, so
  today they repeat `graph_capture_split` / `graph_short_list`, kept for the `grid-split`
  step that compared them;
- `graph_before` / `short_list_before`: the tiles before 015e6a7 (tf32 expand dot, splits for
  four programs a multiprocessor everywhere), whatever the default;
- `maxrank64` / `maxrank64_no_buckets` (r < 64, grouped): launches bounded at the engine's
  max rank 64, with and without rank-bucketed tiles;
- `rows` / `rows_maxrank64`: the row kernels (`slora_kernels.lora_rows`: each token reads its own
  adapter through its slot, no tile list; K split fixed from B), at the case's rank and bounded
  at the engine's max rank 64;
- `gather_bmm`: per-row gather of A and B, two bmm calls; and the bytes floor;
- `vllm` (with `--vllm-src`): vLLM's own Triton shrink and expand (`bench.vllm_lora`), called
  as its punica wrapper calls them, on the same layers, timed the same way.

    python -m bench.kernels_lora_grid --out bench/results/lora-grid-h200.json
    python -m bench.kernels_lora_grid --cases 64x256x1,16x64x1 \
        --variants graph_capture_split,graph_short_list   # a part of it
"""

from __future__ import annotations

import argparse
import dataclasses
import random
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from bench import kernels_lora as kl
from bench import kernels_timing as timing
from bench import vllm_lora
from bench.kernels_timing import DEVICE, copy_bandwidth_gbs, graph_time_us
from bench.run_record import run_record, save_rows
from slora_kernels.lora import (
    DECODE_TILES,
    LoraTiles,
    add_lora_triton,
    pick_split,
    rank_block,
    split_cap,
)
from slora_kernels.lora_meta import DECODE_BLOCK_M, ROW_BLOCK_M, LoraMeta
from slora_kernels.lora_rows import RowTiles

RANKS: tuple[int, ...] = (8, 16, 64)
BATCHES: tuple[int, ...] = (1, 16, 64, 256)
# vLLM's Triton LoRA kernels on the same H200 and inputs, as issue 15 quotes them (us); with
# --vllm-src they are also run here, side by side (`vllm_us`).
VLLM_US = {(16, 64, 1): 7.6, (16, 256, 1): 11.0, (16, 256, 64): 35.5, (16, 256, 256): 126.4,
           (64, 16, 1): 8.2, (64, 64, 1): 9.4, (64, 256, 1): 12.6, (64, 256, 64): 59.4,
           (64, 256, 256): 209.7, (8, 256, 1): 12.8}
BUDGET = dataclasses.replace(DECODE_TILES, split_rank_budget=256)
NO_BUCKETS = dataclasses.replace(DECODE_TILES, rank_buckets=False)
EARLY = dataclasses.replace(DECODE_TILES, early_loads=True)
# Programmatic dependent launch on (`LoraTiles.pdl`) and off, whatever the default.
PDL, NO_PDL = (dataclasses.replace(DECODE_TILES, pdl=on) for on in (True, False))
ROWS_PDL, ROWS_NO_PDL = RowTiles(pdl=True), RowTiles(pdl=False)
WAVE = dataclasses.replace(DECODE_TILES, wave_split=True)
BEFORE = dataclasses.replace(DECODE_TILES, wave_split=False)
# The best tiles at r16 B64 U64 in decode-sweep-lora-h200.json (16.1 vs 20.7 us): wider
# expand and shrink tiles, the K split at most 4 (`wide_split4`).
WIDE = dataclasses.replace(DECODE_TILES, expand_block_n=512, shrink_block_k=512)


def padded_meta(slots: list[int], capacity: int, block_m: int = DECODE_BLOCK_M) -> LoraMeta:
    """The step's tile list (`block_m`-row tiles) padded with unused entries to the graph's
    capacity."""
    meta = LoraMeta.from_token_slots(slots, device=DEVICE, block_m=block_m)
    pad = torch.full((capacity - meta.num_tiles,), -1, dtype=torch.int32, device=DEVICE)
    return dataclasses.replace(
        meta, tile_segs=torch.cat([meta.tile_segs, pad]),
        tile_m0=torch.cat([meta.tile_m0, torch.zeros_like(pad)]), num_tiles=capacity)


def call(lay: kl.LoraLayer, meta: LoraMeta, max_rank: int,
         tiles: LoraTiles | RowTiles = DECODE_TILES,
         split_k: int | None = None) -> Callable[[], None]:
    return lambda: add_lora_triton(lay.y, lay.x, lay.arena, lay.a_offsets, lay.b_offsets,
                                   lay.ranks, lay.scales, (0,), ((0, kl.N),), meta,
                                   max_rank=max_rank, split_k=split_k, tiles=tiles)


def rel_err_f64(lay: kl.LoraLayer, slots: list[int], fn: Callable[[], None]) -> float:
    """One call's delta against float64 torch on the same layer. y is redrawn first: timing
    adds the same delta into it hundreds of times, and once |y| >> |delta| the fp16 rounding
    of y alone would swamp the comparison."""
    lay.y.normal_()
    y0 = lay.y.clone()
    fn()
    got = lay.y.double() - y0.double()
    lay.y.copy_(y0)
    ref = torch.zeros_like(got)
    idx = torch.tensor(slots, device=lay.y.device)
    for u in sorted(set(slots)):
        rows = idx == u
        h = lay.x[rows].double() @ lay.a_stack[u].double().T
        ref[rows] = h @ lay.b_stack[u].double().T * float(lay.scales[u, 0])
    return float((got - ref).norm() / ref.norm())


Variant = tuple[LoraMeta, int, LoraTiles | RowTiles, int | None]


def variants(slots: list[int], rank: int) -> dict[str, Variant]:
    """name -> (meta, max_rank, tiles, fixed split) for one case."""
    b = len(slots)
    grph = padded_meta(slots, b)
    dev, block_r = torch.device(DEVICE), rank_block(rank)

    def split(tiles: LoraTiles, num_tiles: int) -> int:
        return pick_split(tiles, num_tiles, 1, kl.K, dev, block_r)

    capture = split(DECODE_TILES, b)
    exact = LoraMeta.from_token_slots(slots, device=DEVICE, block_m=DECODE_BLOCK_M)
    rows = LoraMeta.from_token_slots(slots, device=DEVICE, block_m=ROW_BLOCK_M)
    out: dict[str, Variant] = {
        "graph_capture_split": (grph, rank, DECODE_TILES, capture),
        "exact": (exact, rank, DECODE_TILES, None),
        "early_loads": (grph, rank, EARLY, capture),
        "rows": (rows, rank, RowTiles(), None),
        "graph_pdl": (grph, rank, PDL, capture),
        "graph_no_pdl": (grph, rank, NO_PDL, capture),
        "rows_pdl": (rows, rank, ROWS_PDL, None),
        "rows_no_pdl": (rows, rank, ROWS_NO_PDL, None),
        "graph_wave": (grph, rank, WAVE, split(WAVE, b)),
        "graph_before": (grph, rank, BEFORE, split(BEFORE, b))}
    if len(set(slots)) >= max(2, b // 4):
        out["wide_split4"] = (grph, rank, WIDE, min(4, capture))
    short = -(-b // DECODE_BLOCK_M)
    if short < b and exact.num_tiles <= short:
        short_split = split(DECODE_TILES, short)
        out["graph_short_list"] = (padded_meta(slots, short), rank, DECODE_TILES, short_split)
        out["short_list_pdl"] = (padded_meta(slots, short), rank, PDL, short_split)
        out["short_list_no_pdl"] = (padded_meta(slots, short), rank, NO_PDL, short_split)
        for name, t in (("wave", WAVE), ("before", BEFORE)):
            out[f"short_list_{name}"] = (padded_meta(slots, short), rank, t, split(t, short))
    if rank == 64:  # below rank 64 the budget allows every split anyway
        out["budget256"] = (grph, rank, BUDGET, min(capture, split_cap(BUDGET, kl.K, 64)))
    elif slots == sorted(slots):
        out["maxrank64"] = (grph, 64, DECODE_TILES, capture)
        out["rows_maxrank64"] = (rows, 64, RowTiles(), None)
        out["rows_maxrank64_pdl"] = (rows, 64, ROWS_PDL, None)
        out["maxrank64_no_buckets"] = (grph, 64, NO_BUCKETS, capture)
    return out


def variant_names() -> set[str]:
    """Every variant some case of the grid times (the --variants choices)."""
    names: set[str] = set()
    for rank in (16, 64):
        for slots in ([0] * 32, list(range(32))):
            names |= variants(slots, rank).keys()
    return names


def run_case(rank: int, b: int, u: int, order: str, copy_gbs: float,
             only: set[str] | None = None, vllm_ops: Any = None) -> dict[str, object]:
    slots = kl.decode_slots(b, u)
    if order == "random":
        random.Random(b * 1000 + u).shuffle(slots)
    layers = kl.build_layers(slots, u, rank)
    row: dict[str, object] = {"rank": rank, "batch": b, "adapters": u, "order": order,
                              "floor_us": kl.floor_bytes(b, u, rank) / (copy_gbs * 1e3)}
    for name, (meta, max_rank, tiles, split) in variants(slots, rank).items():
        if only is not None and name not in only:
            continue
        row[f"{name}_us"] = graph_time_us([call(lay, meta, max_rank, tiles, split)
                                           for lay in layers], replays=10)
        row[f"{name}_rel_err"] = rel_err_f64(layers[0], slots,
                                             call(layers[0], meta, max_rank, tiles, split))
    sl = torch.tensor(slots, device=DEVICE)
    row["gather_bmm_us"] = graph_time_us([kl.gather_bmm(lay, sl) for lay in layers[:4]],
                                         replays=10)
    if vllm_ops is not None:
        theirs = vllm_lora.calls(vllm_ops, layers, slots)
        row["vllm_us"] = graph_time_us(theirs, replays=10)
        row["vllm_rel_err"] = rel_err_f64(layers[0], slots, theirs[0])
    if (rank, b, u) in VLLM_US:
        row["vllm_us_issue"] = VLLM_US[(rank, b, u)]
    del layers
    if DEVICE == "cuda":
        torch.cuda.empty_cache()
    return row


def cases(only: set[tuple[int, int, int]] | None = None) -> list[tuple[int, int, int, str]]:
    """The grid's cases, or those of it whose (rank, batch, adapters) `only` names."""
    out = []
    for rank in RANKS:
        for b in BATCHES:
            for u in sorted({1, max(1, b // 4), b}):
                if only is not None and (rank, b, u) not in only:
                    continue
                for order in ("grouped", "random") if u > 1 else ("grouped",):
                    out.append((rank, b, u, order))
    return out


def parse_cases(text: str) -> set[tuple[int, int, int]]:
    """'64x256x1,16x64x64' -> {(64, 256, 1), (16, 64, 64)}, each a case of the grid."""
    grid = {c[:3] for c in cases()}
    out = set()
    for part in text.split(","):
        try:
            r, b, u = (int(v) for v in part.strip().split("x"))
        except ValueError:
            raise SystemExit(f"--cases: {part!r} is not RANKxBATCHxADAPTERS") from None
        if (r, b, u) not in grid:
            raise SystemExit(f"--cases: {part!r} is not in the grid (ranks {RANKS}, batches "
                             f"{BATCHES}, adapters 1, B/4, B)")
        out.add((r, b, u))
    return out


def main(argv: list[str] | None = None) -> int:
    global RANKS, BATCHES
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default=None)
    ap.add_argument("--toy", action="store_true", help="CPU smoke sizes (hidden 512)")
    ap.add_argument("--cases", default=None,
                    help="only these cases, RANKxBATCHxADAPTERS comma-separated (both orders)")
    ap.add_argument("--variants", default=None,
                    help="only these variants, comma-separated, or 'all' (the default; "
                         "gather_bmm and the floor always)")
    ap.add_argument("--vllm-src", type=Path, default=None,
                    help="run vLLM's LoRA kernels side by side, from this folder "
                         "(python -m bench.vllm_lora --fetch DIR writes it)")
    args = ap.parse_args(argv)
    vllm_ops = vllm_lora.load(args.vllm_src) if args.vllm_src else None
    if args.toy:
        kl.K = kl.N = 512
        timing.MAX_ROTATION = 1
        RANKS, BATCHES = (8, 64), (1, 16)
    only_cases = parse_cases(args.cases) if args.cases else None
    only = None
    if args.variants and args.variants != "all":
        only = {v.strip() for v in args.variants.split(",")}
        unknown = only - variant_names()
        if unknown:
            raise SystemExit(f"--variants: no such variant {sorted(unknown)}; choose from "
                             f"{sorted(variant_names())}")
    todo = cases(only_cases)
    copy = copy_bandwidth_gbs(1 << 30 if DEVICE == "cuda" else 1 << 20)
    copy_gbs = max(copy.values())
    rows: list[dict[str, object]] = []
    result = {**run_record(["bench.kernels_lora_grid", *(argv or sys.argv[1:])]),
              "dtype": "float16", "hidden": kl.K, "copy_gbs": copy, "method":
              "median of 10 CUDA-graph replays, >= 24 calls a graph over inputs rotated past "
              "the L2", "vllm_source": "issue 15's quoted H200 times (vllm_us_issue)" + (
                  f"; {vllm_lora.version(args.vllm_src)}'s kernels run here (vllm_us)"
                  if args.vllm_src else ""),
              "cases": len(todo), "grid_cases": len(cases()),
              "variants": sorted(only) if only else "all", "rows": rows}
    for case in todo:
        row = run_case(*case, copy_gbs, only, vllm_ops)
        rows.append(row)
        print(" ".join(f"{k}={v:.2f}" if isinstance(v, float) else f"{k}={v}"
                       for k, v in row.items() if not k.endswith("rel_err")), flush=True)
        save_rows(args.out, result, rows, len(todo))
    return 0


if __name__ == "__main__":
    sys.exit(main())
