"""How many elements the sole-adapter merge must keep exact values of, against the delta's size.

The merge (slora_core/lora_merge.py) restores W from W' = round(W + d) as round(W' - d) and keeps
the original value of every element where that is not W bit for bit. This measures that share
for one 4096-wide projection (1,024 rows, weights N(0, 0.02), a rank-16 delta scaled to a given
ratio of the weights' standard deviation), in fp16 and bf16, with the merge's own arithmetic,
beside the merge's budget (MAX_EXCEPTION_FRACTION). Pure arithmetic: the CPU gives the GPU's
answer up to the delta GEMM's rounding.

    python -m bench.merge_exceptions --out bench/results/merge-exceptions-cpu.json
"""

from __future__ import annotations

import argparse
import json
import sys

import torch

from bench.run_record import run_record
from slora_core.lora_merge import MAX_EXCEPTION_FRACTION, _bits, delta, wide

RATIOS = (0.003, 0.01, 0.03, 0.1, 0.3, 1.0)
ROWS, K, RANK = 1024, 4096, 16


def share(dtype: torch.dtype, ratio: float, gen: torch.Generator) -> dict[str, float]:
    w = (torch.randn(ROWS, K, generator=gen) * 0.02).to(dtype)
    a = torch.randn(RANK, K, generator=gen).to(dtype)
    b0 = torch.randn(ROWS, RANK, generator=gen)
    b = (b0 * (ratio * 0.02 / float((b0 @ a.float()).std()))).to(dtype)
    acc = wide(dtype)
    d = delta(a, b, 1.0, acc)
    merged = (w.to(acc) + d).to(dtype)
    inexact = _bits((merged.to(acc) - d).to(dtype)) != _bits(w)
    return {"delta_to_weight_std": float(d.std() / w.to(acc).std()),
            "exception_share": float(inexact.float().mean())}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    gen = torch.Generator().manual_seed(0)
    rows = []
    for dtype in (torch.float16, torch.bfloat16):
        for ratio in RATIOS:
            got = share(dtype, ratio, gen)
            row = {"dtype": str(dtype).removeprefix("torch."), "ratio": ratio, **got,
                   "merged": got["exception_share"] <= MAX_EXCEPTION_FRACTION}
            rows.append(row)
            print(f"{row['dtype']} delta/W {row['delta_to_weight_std']:.3f}: "
                  f"{row['exception_share']:.4f} of the elements kept "
                  f"({'merged' if row['merged'] else 'refused'})", flush=True)
    result = {**run_record(["bench.merge_exceptions", *(argv or sys.argv[1:])]),
              "shape": {"rows": ROWS, "in_features": K, "rank": RANK},
              "budget": MAX_EXCEPTION_FRACTION, "rows": rows}
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
