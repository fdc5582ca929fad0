"""The base model's decode GEMMs (y = x @ W.T, fp16, Llama-2-7B projection shapes) by CUDA-graph
replay over weights rotated past the L2, under each BLAS backend torch offers on CUDA
(`torch.backends.cuda.preferred_blas_library`: cuBLAS, the default, and cuBLASLt) and under the
Triton weight-streaming kernel (kernels.gemm_decode.linear_decode with its default config; at
M=64 also a small config sweep, "triton_sweep" in the JSON), beside each shape's bytes floor at
copy bandwidth. Every variant is checked against float64 first. At batch 64 these GEMMs read
the weights once a step: the decode step's floor counts those bytes, so their excess is the
step's.

    python -m bench.gemm_decode --out bench/results/gemm-decode-h200.json
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys

import torch
import torch.nn.functional as F

from bench.kernels_timing import DEVICE, copy_bandwidth_gbs, graph_time_us, rotation_count
from bench.run_record import run_record
from kernels.gemm_decode import GemmDecodeConfig, linear_decode, pick_config

# (name, N, K) of Llama-2-7B's fused projections.
SHAPES = (("qkv", 12288, 4096), ("o", 4096, 4096), ("gate_up", 22016, 4096),
          ("down", 4096, 11008))
LIBRARIES = ("cublas", "cublaslt")
SWEEP_M = 64
# Sweep at SWEEP_M, beside the default config: (block_n, block_k, num_stages) with split_k by
# pick_config's rule for those tiles, then the default tiles at half and twice its split_k.
SWEEP_TILES = ((64, 128, 4), (64, 128, 3), (64, 64, 5), (64, 256, 3), (128, 64, 5),
               (128, 128, 4), (256, 64, 4))


class Inputs:
    """`count` weight/input/output sets of one shape (rotated past the L2) and the float64
    product of the first, shared by every variant timed on the shape."""

    def __init__(self, m: int, n: int, k: int) -> None:
        count = rotation_count(n * k * 2)
        self.ws = [torch.randn(n, k, dtype=torch.float16, device=DEVICE) * 0.02
                   for _ in range(count)]
        self.xs = [torch.randn(m, k, dtype=torch.float16, device=DEVICE) for _ in range(count)]
        self.ys = [torch.empty(m, n, dtype=torch.float16, device=DEVICE) for _ in range(count)]
        self.ref = self.xs[0].double() @ self.ws[0].double().T

    def check(self, label: str, got: torch.Tensor) -> None:
        err = float((got.double() - self.ref).norm() / self.ref.norm())
        if err > 1e-2:
            raise RuntimeError(f"{label}: rel err {err:.2e} against float64")


def time_gemm(inputs: Inputs, library: str) -> float:
    torch.backends.cuda.preferred_blas_library(library)
    x, w = inputs.xs[0], inputs.ws[0]
    inputs.check(f"{library} M{x.shape[0]} N{w.shape[0]} K{w.shape[1]}", F.linear(x, w))
    calls = [lambda x=x, w=w, y=y: torch.matmul(x, w.T, out=y)
             for x, w, y in zip(inputs.xs, inputs.ws, inputs.ys, strict=True)]
    return graph_time_us(calls)


def time_triton(inputs: Inputs, config: GemmDecodeConfig | None) -> float:
    """linear_decode with `config` (None: pick_config's), checked against float64 twice in a
    row (the split-K counters must come back to 0), then timed like the BLAS calls."""
    x, w, y = inputs.xs[0], inputs.ws[0], inputs.ys[0]
    for _ in range(2):
        y.fill_(float("nan"))
        inputs.check(f"triton {config} M{x.shape[0]} N{w.shape[0]} K{w.shape[1]}",
                      linear_decode(x, w, y, config=config))
    calls = [lambda x=x, w=w, y=y: linear_decode(x, w, y, config=config)
             for x, w, y in zip(inputs.xs, inputs.ws, inputs.ys, strict=True)]
    return graph_time_us(calls)


def sweep_configs(m: int, n: int, k: int, num_sms: int) -> list[GemmDecodeConfig]:
    base = pick_config(m, n, k, num_sms)
    configs = [base]
    for bn, bk, stages in SWEEP_TILES:
        configs.append(pick_config(m, n, k, num_sms, block_n=bn, block_k=bk, num_stages=stages))
    for split in (max(1, base.split_k // 2), base.split_k * 2):
        configs.append(dataclasses.replace(base, split_k=split))
    return list(dict.fromkeys(configs))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--batches", default="16,64,128,256")
    p.add_argument("--no-sweep", action="store_true",
                   help=f"skip the linear_decode config sweep at M={SWEEP_M}")
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    copy_gbs = max(copy_bandwidth_gbs(1 << 30).values())
    num_sms = torch.cuda.get_device_properties(DEVICE).multi_processor_count
    default = torch.backends.cuda.preferred_blas_library()
    rows = []
    sweep: list[dict[str, object]] = []
    columns = (*LIBRARIES, "triton")
    for m in (int(b) for b in args.batches.split(",")):
        for name, n, k in SHAPES:
            floor_us = (n * k + m * (n + k)) * 2 / (copy_gbs * 1e3)
            row: dict[str, object] = {"shape": name, "m": m, "n": n, "k": k,
                                      "floor_us": floor_us}
            inputs = Inputs(m, n, k)
            for lib in LIBRARIES:
                row[f"{lib}_us"] = time_gemm(inputs, lib)
            torch.backends.cuda.preferred_blas_library(default)
            row["triton_config"] = dataclasses.asdict(pick_config(m, n, k, num_sms))
            row["triton_us"] = time_triton(inputs, None)
            for col in columns:
                row[f"{col}_x_floor"] = float(row[f"{col}_us"]) / floor_us  # type: ignore[arg-type]
            rows.append(row)
            print(f"M{m:4d} {name:8s} floor {floor_us:7.1f} us  " + "  ".join(
                f"{col} {row[f'{col}_us']:7.1f} ({row[f'{col}_x_floor']:.2f}x)"
                for col in columns), flush=True)
            if m == SWEEP_M and not args.no_sweep:
                for config in sweep_configs(m, n, k, num_sms):
                    us = time_triton(inputs, config)
                    sweep.append({"shape": name, "m": m, "n": n, "k": k,
                                  **dataclasses.asdict(config), "us": us,
                                  "x_floor": us / floor_us})
                    print(f"    sweep {name:8s} {config}: {us:7.1f} us "
                          f"({us / floor_us:.2f}x)", flush=True)
            del inputs
    torch.backends.cuda.preferred_blas_library(default)
    result = {**run_record(["bench.gemm_decode", *(argv or sys.argv[1:])]),
              "default_library": str(default), "copy_gbs": copy_gbs, "num_sms": num_sms,
              "rows": rows, "triton_sweep": sweep}
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
