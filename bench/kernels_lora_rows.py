"""Row-kernel tile sweep beside the tile kernels, on the decode cases that set the step time.

For each case (rank, B rows, U adapters, the launch's rank bound) it times, by CUDA-graph
replay over inputs rotated past the L2 (one 4096x4096 module, fp16): the tile kernels as
decode graphs run them (`graph_capture_split`), and the row kernels (`slora_kernels.lora_rows`) for
a list of RowTiles choices (CONFIGS: register tiles, expand columns and sub-tiles, warps);
each beside the bytes floor and with its error against float64 torch. It also times a pair of empty Triton launches: the
least any two-launch LoRA can take in a graph.

    python -m bench.kernels_lora_rows --out bench/results/lora-rows-h200.json
"""

from __future__ import annotations

import argparse
import dataclasses
import sys

import torch
import triton
import triton.language as tl

from bench import kernels_lora as kl
from bench import kernels_timing as timing
from bench.kernels_lora_grid import call, padded_meta, rel_err_f64
from bench.kernels_timing import DEVICE, copy_bandwidth_gbs, graph_time_us
from bench.run_record import run_record, save_rows
from slora_kernels.lora import DECODE_TILES, pick_split_k
from slora_kernels.lora_meta import ROW_BLOCK_M, LoraMeta
from slora_kernels.lora_rows import RowTiles

# (rank, rows, adapters, the launch's rank bound): the engine's decode case (64 requests on 64
# adapters, bound 64), the floor case (B256 U256 r16) and their neighbours.
CASES: tuple[tuple[int, int, int, int], ...] = (
    (16, 64, 64, 16), (16, 64, 64, 64), (16, 256, 256, 16), (16, 256, 64, 16),
    (16, 64, 16, 16), (64, 256, 256, 64), (64, 64, 64, 64), (8, 256, 256, 64))
# The defaults (the expand's register tile capped at 4096 elements), uncapped (the default
# before lora-rows-sweep-fd01907-h200.json) and capped at 2048, one warp (best for rank-16
# adapters in rank-64 launches in lora-rows-sweep-964ec9e-h200.json, uncapped), wider expand
# tiles and a smaller shrink tile.
# Since the expand became the shrink's programmatic dependent (RowTiles.pdl, on by default),
# the same knobs again with it, beside the default without it; expand columns fixed at every
# row count (block_n and wide_block_n alike), and 256 at 256 rows (the default before
# wide_block_n).
CONFIGS = (RowTiles(), RowTiles(pdl=False), RowTiles(num_warps=1), RowTiles(num_warps=4),
           RowTiles(block_n=128, wide_block_n=128), RowTiles(block_n=512, wide_block_n=512),
           RowTiles(wide_block_n=256), RowTiles(tile=1024),
           RowTiles(tile=4096), RowTiles(programs_per_sm=2), RowTiles(programs_per_sm=8),
           RowTiles(max_split_k=4), RowTiles(expand_sub_tile=2048))


@triton.jit
def _touch(p):
    tl.store(p, tl.load(p) + 1)


def empty_pair_us() -> float:
    """Two back-to-back one-load launches: the graph's per-pair launch floor."""
    t = torch.zeros(1, dtype=torch.int32, device=DEVICE)

    def pair() -> None:
        _touch[(1,)](t)
        _touch[(1,)](t)

    return graph_time_us([pair], replays=10)


def run_case(rank: int, b: int, u: int, bound: int, copy_gbs: float,
             configs: list[RowTiles]) -> dict[str, object]:
    slots = kl.decode_slots(b, u)
    layers = kl.build_layers(slots, u, rank)
    row: dict[str, object] = {"rank": rank, "batch": b, "adapters": u, "max_rank": bound,
                              "floor_us": kl.floor_bytes(b, u, rank) / (copy_gbs * 1e3)}
    split = pick_split_k(b, kl.K, torch.device(DEVICE), DECODE_TILES.max_split_k)
    grph = padded_meta(slots, b)
    tile_calls = [call(lay, grph, bound, DECODE_TILES, split) for lay in layers]
    row["graph_capture_split_us"] = graph_time_us(tile_calls, replays=10)
    rows = LoraMeta.from_token_slots(slots, device=DEVICE, block_m=ROW_BLOCK_M)
    sweep = []
    for tiles in configs:
        us = graph_time_us([call(lay, rows, bound, tiles) for lay in layers], replays=10)
        err = rel_err_f64(layers[0], slots, call(layers[0], rows, bound, tiles))
        sweep.append({**dataclasses.asdict(tiles), "us": us, "rel_err": err,
                      "default": tiles == RowTiles()})
    row["rows"] = sweep
    best = min(sweep, key=lambda s: float(s["us"]))  # type: ignore[arg-type]
    row["rows_best"] = best
    row["rows_default_us"] = next(s["us"] for s in sweep if s["default"])
    del layers
    if DEVICE == "cuda":
        torch.cuda.empty_cache()
    return row


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default=None)
    ap.add_argument("--toy", action="store_true", help="CPU smoke sizes (hidden 512)")
    args = ap.parse_args(argv)
    cases, configs = CASES, list(CONFIGS)
    if args.toy:
        kl.K = kl.N = 512
        timing.MAX_ROTATION = 1
        cases, configs = ((16, 16, 16, 16),), [RowTiles(),
                                               RowTiles(block_n=64, expand_sub_tile=512)]
    copy = copy_bandwidth_gbs(1 << 30 if DEVICE == "cuda" else 1 << 20)
    rows: list[dict[str, object]] = []
    result = {**run_record(["bench.kernels_lora_rows", *(argv or sys.argv[1:])]),
              "dtype": "float16", "hidden": kl.K, "copy_gbs": copy,
              "method": "median of 10 CUDA-graph replays, >= 24 calls a graph over inputs "
                        "rotated past the L2", "empty_pair_us": empty_pair_us(), "rows": rows}
    for case in cases:
        row = run_case(*case, max(copy.values()), configs)
        rows.append(row)
        best = row["rows_best"]
        sweep_us = [round(float(s["us"]), 2) for s in row["rows"]]  # type: ignore[attr-defined]
        print(f"r{case[0]} B{case[1]} U{case[2]} bound{case[3]} floor={row['floor_us']:.2f} "
              f"tiles={row['graph_capture_split_us']:.2f} rows_default="
              f"{row['rows_default_us']:.2f} best={best} all_us={sweep_us}", flush=True)
        save_rows(args.out, result, rows, len(cases))
    print(f"empty launch pair: {result['empty_pair_us']:.2f} us")
    return 0


if __name__ == "__main__":
    sys.exit(main())
