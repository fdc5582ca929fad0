"""Variants of the decode step's pieces at the issue's shape (batch 64, context 512, fp16), by
CUDA-graph replay, beside the default each runs today (issue 15: the step toward its floor;
issue 13: what the float32 logits cost):

- `attention`: the decode attention kernel's tiles (block_n x num_warps x num_stages) at
  Llama-2-7B (MHA) and Llama-3-8B (GQA) widths, fraction of copy bandwidth;
- `lora`: the decode LoRA launch pair's tiles for one adapter on every row (the most common
  production case) at r16/r64 and B 64/256: expand block_n and warps, shrink block_k;
- `logits`: the LM head (vocab 32,000 x hidden 4,096) writing fp16 logits then casting (HF's
  order, and ours before f7fb1c6) vs float32 logits straight from the GEMM
  (`ops.linear_float32`), at 1, 64 and 256 rows.

    python -m bench.decode_sweep --out bench/results/decode-sweep-h200.json
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
import sys
from collections.abc import Callable
from typing import Any

import torch

from bench import kernels_attention as attn
from bench import kernels_lora as kl
from bench.kernels_timing import DEVICE, copy_bandwidth_gbs, graph_time_us
from bench.run_record import run_record
from slora_core import ops
from slora_kernels.lora import DECODE_TILES, add_lora_triton
from slora_kernels.lora_meta import DECODE_BLOCK_M, LoraMeta
from slora_kernels.paged_attention import DEFAULT_TILES

ATTN_SHAPES = (("llama2-7b", 64, 512), ("llama3-8b", 64, 512))
LORA_CASES = ((16, 64), (16, 256), (64, 64), (64, 256))  # (rank, rows), one adapter


ATTN_GRID = tuple(itertools.product((32, 64, 128), (2, 4, 8), (2, 3, 4)))
# The other shapes of bench.kernels' decode table, for a few candidates (--attn-wide).
WIDE_SHAPES = (("llama2-7b", 1, 4096), ("llama2-7b", 16, 2048), ("llama2-7b", 256, 1024),
               ("llama3-8b", 1, 4096), ("llama3-8b", 16, 2048), ("llama3-8b", 256, 1024))


def attention_rows(copy_gbs: float, shapes: tuple[tuple[str, int, int], ...] = ATTN_SHAPES,
                   grid: tuple[tuple[int, ...], ...] = ATTN_GRID) -> list[dict[str, Any]]:
    rows = []
    for model, batch, ctx in shapes:
        for n, w, s in grid:
            tiles = dataclasses.replace(DEFAULT_TILES, decode_block_n=n, decode_num_warps=w,
                                        decode_num_stages=s)
            try:
                row = attn.decode_case(model, batch, ctx, copy_gbs, tiles,
                                       with_baselines=False)
            except Exception as e:  # noqa: BLE001 - a variant that cannot compile is a result
                row = {"model": model, "batch": batch, "context": ctx,
                       "error": f"{type(e).__name__}: {e}"[:300]}
            rows.append({"block_n": n, "num_warps": w, "num_stages": s,
                         "default": tiles == DEFAULT_TILES, **row})
            if DEVICE == "cuda":
                torch.cuda.empty_cache()
    return rows


# (expand block_n, shrink block_k, warps, fixed K split or None) tried with --lora-cases.
LORA_WIDE = tuple(itertools.product((128, 256, 512), (256, 512), (4, 8), (None, 2, 4)))


def lora_rows(copy_gbs: float, cases: tuple[tuple[int, int, int], ...] | None = None
              ) -> list[dict[str, Any]]:
    """The pair's tiles for (rank, rows, adapters) cases: one adapter over LORA_CASES by
    default; with `cases`, LORA_WIDE's tiles and K splits too (adapters spread evenly)."""
    rows = []
    grid = LORA_WIDE if cases else tuple(
        (bn, bk, w, None) for bn, bk, w in itertools.product((64, 128, 256), (128, 256, 512),
                                                             (2, 4)))
    for rank, b, u in cases or tuple((r, b, 1) for r, b in LORA_CASES):
        slots = kl.decode_slots(b, u)
        layers = kl.build_layers(slots, u, rank)
        meta = LoraMeta.from_token_slots(slots, device=DEVICE, block_m=DECODE_BLOCK_M)
        for bn, bk, w, split in grid:
            tiles = dataclasses.replace(DECODE_TILES, expand_block_n=bn, shrink_block_k=bk,
                                        num_warps=w)

            def call(lay: kl.LoraLayer, t: Any = tiles, m: LoraMeta = meta,
                     r: int = rank, sk: int | None = split) -> Callable[[], None]:
                return lambda: add_lora_triton(lay.y, lay.x, lay.arena, lay.a_offsets,
                                               lay.b_offsets, lay.ranks, lay.scales, (0,),
                                               ((0, kl.N),), m, max_rank=r, tiles=t,
                                               split_k=sk)

            rows.append({"rank": rank, "batch": b, "adapters": u, "expand_block_n": bn,
                         "shrink_block_k": bk, "num_warps": w, "split_k": split,
                         "default": tiles == DECODE_TILES and split is None,
                         "floor_us": kl.floor_bytes(b, u, rank) / (copy_gbs * 1e3),
                         "us": graph_time_us([call(lay) for lay in layers], replays=10)})
        del layers
    return rows


def logits_rows(copy_gbs: float) -> list[dict[str, Any]]:
    vocab, hidden = (32000, 4096) if DEVICE == "cuda" else (512, 64)
    w = torch.randn(vocab, hidden, dtype=torch.float16, device=DEVICE) * 0.02
    rows = []
    for m in (1, 64, 256):
        x = torch.randn(m, hidden, dtype=torch.float16, device=DEVICE)

        def rounded(x: torch.Tensor = x) -> torch.Tensor:
            return torch.nn.functional.linear(x, w).float()

        def kept(x: torch.Tensor = x) -> torch.Tensor:
            return ops.linear_float32(x, w)

        fp16 = graph_time_us([rounded], replays=20)
        fp32 = graph_time_us([kept], replays=20)
        floor = (w.numel() * 2 + m * vocab * 4) / (copy_gbs * 1e3)
        rows.append({"rows": m, "fp16_out_then_float_us": fp16, "float32_out_us": fp32,
                     "ratio": fp32 / fp16, "floor_us": floor})
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default=None)
    ap.add_argument("--parts", nargs="+", default=["logits", "lora", "attention"])
    ap.add_argument("--attn-wide", nargs="*", default=None, metavar="N,W,S",
                    help="attention on WIDE_SHAPES too, for these tiles and the default's")
    ap.add_argument("--lora-cases", nargs="*", default=None, metavar="R,B,U",
                    help="LoRA part: these (rank, rows, adapters) cases over LORA_WIDE")
    args = ap.parse_args(argv)
    lora_cases = tuple(tuple(int(v) for v in c.split(",")) for c in args.lora_cases or ())
    copy = copy_bandwidth_gbs(1 << 30 if DEVICE == "cuda" else 1 << 20)
    copy_gbs = max(copy.values())
    result: dict[str, Any] = {**run_record(["bench.decode_sweep", *(argv or sys.argv[1:])]),
                              "copy_gbs": copy, "method": "CUDA-graph replay, median"}
    fns: dict[str, Callable[[float], list[dict[str, Any]]]] = {
        "logits": logits_rows, "attention": attention_rows,
        "lora": lambda gbs: lora_rows(gbs, lora_cases or None)}  # type: ignore[arg-type]
    if args.attn_wide is not None:
        dflt = (DEFAULT_TILES.decode_block_n, DEFAULT_TILES.decode_num_warps,
                DEFAULT_TILES.decode_num_stages)
        grid = (dflt, *(tuple(int(v) for v in t.split(",")) for t in args.attn_wide))
        fns["attention_wide"] = lambda gbs: attention_rows(gbs, WIDE_SHAPES + ATTN_SHAPES,
                                                           grid)
    for part in args.parts:
        result[part] = fns[part](copy_gbs)
        if args.out:
            with open(args.out, "w") as f:
                json.dump(result, f, indent=1)
    for r in result.get("logits", []):
        print(f"logits rows={r['rows']}: fp16-out {r['fp16_out_then_float_us']:.1f} us, "
              f"float32-out {r['float32_out_us']:.1f} us ({r['ratio']:.3f}x)")
    for rank, b, u in lora_cases or tuple((r, b, 1) for r, b in LORA_CASES):
        rs = [r for r in result.get("lora", [])
              if (r["rank"], r["batch"], r["adapters"]) == (rank, b, u)]
        if rs:
            best, dflt = min(rs, key=lambda r: r["us"]), next(r for r in rs if r["default"])
            print(f"lora r{rank} B{b} U{u}: default {dflt['us']:.1f} us, best {best['us']:.1f} "
                  f"(n{best['expand_block_n']} k{best['shrink_block_k']} "
                  f"w{best['num_warps']} split {best['split_k']}), floor "
                  f"{best['floor_us']:.1f}")
    for model, batch, ctx in ATTN_SHAPES:
        rs = [r for r in result.get("attention", []) if r["model"] == model and "error" not in r]
        if rs:
            best, dflt = min(rs, key=lambda r: r["ours_us"]), next(r for r in rs if r["default"])
            print(f"attention {model} b{batch} ctx{ctx}: default {dflt['ours_us']:.1f} us "
                  f"({dflt['fraction_of_copy_bw']:.2f} of copy bw), best {best['ours_us']:.1f} "
                  f"({best['fraction_of_copy_bw']:.2f}; n{best['block_n']} "
                  f"w{best['num_warps']} s{best['num_stages']})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
