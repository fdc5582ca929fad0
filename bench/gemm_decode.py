"""The base model's decode GEMMs (y = x @ W.T, fp16, Llama-2-7B projection shapes) by CUDA-graph
replay over weights rotated past the L2, under each BLAS backend torch offers on CUDA
(`torch.backends.cuda.preferred_blas_library`: cuBLAS, the default, and cuBLASLt), beside each
shape's bytes floor at copy bandwidth. At batch 64 these GEMMs read the weights once a step:
the decode step's floor counts those bytes, so their excess is the step's.

    python -m bench.gemm_decode --out bench/results/gemm-decode-h200.json
"""

from __future__ import annotations

import argparse
import json
import sys

import torch
import torch.nn.functional as F

from bench.kernels_timing import DEVICE, copy_bandwidth_gbs, graph_time_us, rotation_count
from bench.run_record import run_record

# (name, N, K) of Llama-2-7B's fused projections.
SHAPES = (("qkv", 12288, 4096), ("o", 4096, 4096), ("gate_up", 22016, 4096),
          ("down", 4096, 11008))
LIBRARIES = ("cublas", "cublaslt")


def time_gemm(m: int, n: int, k: int, library: str) -> float:
    torch.backends.cuda.preferred_blas_library(library)
    count = rotation_count(n * k * 2)
    ws = [torch.randn(n, k, dtype=torch.float16, device=DEVICE) * 0.02 for _ in range(count)]
    xs = [torch.randn(m, k, dtype=torch.float16, device=DEVICE) for _ in range(count)]
    ys = [torch.empty(m, n, dtype=torch.float16, device=DEVICE) for _ in range(count)]
    ref = (xs[0].double() @ ws[0].double().T)
    got = F.linear(xs[0], ws[0]).double()
    err = float((got - ref).norm() / ref.norm())
    if err > 1e-2:
        raise RuntimeError(f"{library} M{m} N{n} K{k}: rel err {err:.2e} against float64")
    calls = [lambda x=x, w=w, y=y: torch.matmul(x, w.T, out=y) for x, w, y in zip(xs, ws, ys,
                                                                                  strict=True)]
    return graph_time_us(calls)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--batches", default="16,64,128,256")
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    copy_gbs = max(copy_bandwidth_gbs(1 << 30).values())
    default = torch.backends.cuda.preferred_blas_library()
    rows = []
    for m in (int(b) for b in args.batches.split(",")):
        for name, n, k in SHAPES:
            floor_us = (n * k + m * (n + k)) * 2 / (copy_gbs * 1e3)
            row: dict[str, object] = {"shape": name, "m": m, "n": n, "k": k,
                                      "floor_us": floor_us}
            for lib in LIBRARIES:
                us = time_gemm(m, n, k, lib)
                row[f"{lib}_us"] = us
                row[f"{lib}_x_floor"] = us / floor_us
            rows.append(row)
            print(f"M{m:4d} {name:8s} floor {floor_us:7.1f} us  " + "  ".join(
                f"{lib} {row[f'{lib}_us']:7.1f} ({row[f'{lib}_x_floor']:.2f}x)"
                for lib in LIBRARIES), flush=True)
    torch.backends.cuda.preferred_blas_library(default)
    result = {**run_record(["bench.gemm_decode", *(argv or sys.argv[1:])]),
              "default_library": str(default), "copy_gbs": copy_gbs, "rows": rows}
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
