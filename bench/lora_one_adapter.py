"""Decode LoRA with one adapter on every row (issue 15's U = 1 cells): where the time goes and
which K split and tiles serve it best, on the short tile list decode graphs replay.

For each cell (rank, rows): the shrink's and the expand's device time apart (torch.profiler
over eager launches: kernel durations, not launch gaps), then CUDA-graph replay times of the
short list under K splits 8..64 (finer K tiles past 16 splits), and with the expand launched as the shrink's programmatic dependent or not (`LoraTiles.pdl`) beside
split and column-tile variants. One 4096x4096 module, fp16, inputs rotated past the L2.

    python -m bench.lora_one_adapter --out bench/results/lora-one-adapter-h200.json
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from typing import Any

import torch

from bench import kernels_lora as kl
from bench import kernels_timing as timing
from bench.kernels_lora_grid import VLLM_US, call, padded_meta
from bench.kernels_timing import DEVICE, copy_bandwidth_gbs, graph_time_us
from bench.run_record import add_row, run_record
from slora_kernels.lora import DECODE_TILES, LoraTiles, pick_split_k
from slora_kernels.lora_meta import DECODE_BLOCK_M

CELLS: tuple[tuple[int, int], ...] = ((16, 64), (16, 256), (8, 256), (64, 16), (64, 64),
                                      (64, 256))
# (name, tiles, split or None for the graphs' choice).
CONFIGS: tuple[tuple[str, LoraTiles, int | None], ...] = (
    ("default", DECODE_TILES, None),
    ("split8", DECODE_TILES, 8),
    ("split32_k128", dataclasses.replace(DECODE_TILES, shrink_block_k=128), 32),
    ("default_warps8", dataclasses.replace(DECODE_TILES, num_warps=8), None),
    ("default_bn128", dataclasses.replace(DECODE_TILES, expand_block_n=128), None),
    # The expand launched as a programmatic dependent of the shrink (LoraTiles.pdl), on and
    # off whatever the default, alone and with the variants above that gained at rank 64.
    ("pdl", dataclasses.replace(DECODE_TILES, pdl=True), None),
    ("no_pdl", dataclasses.replace(DECODE_TILES, pdl=False), None),
    ("pdl_warps8", dataclasses.replace(DECODE_TILES, pdl=True, num_warps=8), None),
    # Fewer partial sums for the expand to re-read (r64 B256: 16 splits of 256 rows x 64
    # ranks, re-read by each of the 16 column tiles), or wider column tiles that re-read
    # them less often.
    ("pdl_split4", dataclasses.replace(DECODE_TILES, pdl=True), 4),
    ("pdl_split8", dataclasses.replace(DECODE_TILES, pdl=True), 8),
    ("pdl_bn512", dataclasses.replace(DECODE_TILES, pdl=True, expand_block_n=512), None),
    ("pdl_bn512_split8", dataclasses.replace(DECODE_TILES, pdl=True, expand_block_n=512), 8),
    ("pdl_k512_bn512_split4", dataclasses.replace(DECODE_TILES, pdl=True, shrink_block_k=512,
                                                  expand_block_n=512), 4),
    ("pdl_warps8_split8", dataclasses.replace(DECODE_TILES, pdl=True, num_warps=8), 8),
)


def kernel_us(fn: Any, calls: int = 40) -> dict[str, float]:
    """Mean device microseconds per call of each kernel `fn` launches (torch.profiler)."""
    from torch.profiler import ProfilerActivity, profile

    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
    out: dict[str, float] = {}
    for ev in prof.key_averages():
        if ev.device_type == torch.autograd.DeviceType.CUDA and ev.count:
            name = "shrink" if "shrink" in ev.key else "expand" if "expand" in ev.key else ev.key
            out[name] = out.get(name, 0.0) + ev.device_time_total / calls
    return out


def run_cell(rank: int, b: int, copy_gbs: float) -> dict[str, Any]:
    slots = [0] * b
    layers = kl.build_layers(slots, 1, rank)
    short = -(-b // DECODE_BLOCK_M)
    meta = padded_meta(slots, short)
    graph_split = pick_split_k(short, kl.K, torch.device(DEVICE), DECODE_TILES.max_split_k)
    row: dict[str, Any] = {"rank": rank, "batch": b, "tiles": short, "graph_split": graph_split,
                           "floor_us": kl.floor_bytes(b, 1, rank) / (copy_gbs * 1e3),
                           "vllm_us_issue": VLLM_US.get((rank, b, 1))}
    if DEVICE == "cuda":
        row["kernels_us"] = kernel_us(call(layers[0], meta, rank, DECODE_TILES, graph_split))
    for name, tiles, split in CONFIGS:
        s = split or graph_split
        row[f"{name}_us"] = graph_time_us([call(lay, meta, rank, tiles, s) for lay in layers],
                                          replays=10)
    del layers
    if DEVICE == "cuda":
        torch.cuda.empty_cache()
    return row


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default=None)
    ap.add_argument("--toy", action="store_true", help="CPU smoke sizes (hidden 512)")
    args = ap.parse_args(argv)
    cells = CELLS
    if args.toy:
        kl.K = kl.N = 512
        timing.MAX_ROTATION = 1
        cells = ((16, 16),)
    copy = copy_bandwidth_gbs(1 << 30 if DEVICE == "cuda" else 1 << 20)
    rows: list[dict[str, Any]] = []
    result = {**run_record(["bench.lora_one_adapter", *(argv or sys.argv[1:])]),
              "dtype": "float16", "hidden": kl.K, "copy_gbs": copy,
              "method": "kernels_us: torch.profiler device time per eager call (40 calls); "
              "*_us: median of 10 CUDA-graph replays over inputs rotated past the L2",
              "rows": rows}
    for rank, b in cells:
        add_row(args.out, result, rows, run_cell(rank, b, max(copy.values())), len(cells))
    return 0


if __name__ == "__main__":
    sys.exit(main())
