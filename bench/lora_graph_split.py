"""Decode LoRA the way CUDA graphs run it: the tile list sized for the batch bucket (b entries,
unused ones -1) and the K split fixed at capture from that capacity. Sweeps the split for b
decode rows shared by 1..b adapters (one 4096x4096 module, rank 16, fp16), to pick the split
graphs should capture with.

Why: a graph of bucket 256 captures split 1 (256 tiles x 3 modules already fill the chip), but
when one adapter serves all 256 rows only 16 tiles are real: 48 shrink programs each walk all
of K. That is the leading suspect for the one-adapter vs base gap (0.91-0.94, issue 6).

    python -m bench.lora_graph_split --out bench/results/lora-graph-split-h200.json
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys

import torch

from bench.kernels_lora import DEVICE, N, build_layers, decode_slots, floor_bytes
from bench.kernels_timing import copy_bandwidth_gbs, graph_time_us
from slora_kernels.lora import add_lora_triton, pick_split_k
from slora_kernels.lora_meta import DECODE_BLOCK_M, LoraMeta

RANK = 16
SPLITS = (1, 2, 4, 8, 16)


def padded_meta(slots: list[int], capacity: int) -> LoraMeta:
    """The step's real tile list padded with unused entries to the graph's capacity."""
    meta = LoraMeta.from_token_slots(slots, device=DEVICE, block_m=DECODE_BLOCK_M)
    pad = capacity - meta.num_tiles
    unused = torch.full((pad,), -1, dtype=torch.int32, device=DEVICE)
    return dataclasses.replace(
        meta, tile_segs=torch.cat([meta.tile_segs, unused]),
        tile_m0=torch.cat([meta.tile_m0, torch.zeros_like(unused)]), num_tiles=capacity)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--batches", default="64,256")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    copy_gbs = max(copy_bandwidth_gbs(1 << 30).values())
    rows = []
    for b in (int(x) for x in args.batches.split(",")):
        auto = pick_split_k(b, 4096, torch.device(DEVICE), 16)  # what a capture picks
        for adapters in sorted({1, 4, 16, 64, b}):
            if adapters > b:
                continue
            slots = decode_slots(b, adapters)
            meta = padded_meta(slots, capacity=b)
            layers = build_layers(slots, adapters, RANK)
            row: dict[str, object] = {"batch": b, "adapters": adapters,
                                      "real_tiles": int((meta.tile_segs >= 0).sum()),
                                      "capture_split": auto,
                                      "floor_us": floor_bytes(b, adapters, RANK) / (copy_gbs * 1e3)}
            for split in SPLITS:
                calls = [
                    (lambda lay=lay, s=split, m=meta: add_lora_triton(
                        lay.y, lay.x, lay.arena, lay.a_offsets, lay.b_offsets, lay.ranks,
                        lay.scales, (0,), ((0, N),), m, max_rank=RANK, split_k=s))
                    for lay in layers]
                row[f"split{split}_us"] = graph_time_us(calls)
            rows.append(row)
            print("  ".join(f"{k}={v:.1f}" if isinstance(v, float) else f"{k}={v}"
                            for k, v in row.items()), flush=True)
            del layers
            torch.cuda.empty_cache()
    result = {"command": "python -m bench.lora_graph_split " + " ".join(
        argv if argv is not None else sys.argv[1:]),
        "hardware": torch.cuda.get_device_name(), "copy_gbs": copy_gbs, "rows": rows}
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
