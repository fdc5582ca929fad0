"""One decode layer's four projections with one adapter on every row (merge off): the cost of
the LoRA launches, and what riding the base GEMM would save, before anyone builds it.

Llama-2-7B shapes, fp16, one adapter on all 7 modules, CUDA-graph replay over two layers'
weights (past the L2). Each variant computes the same y for the four projections (qkv, o,
gate_up, down; inputs are independent here, so this is launches and bytes, not the layer's
data flow):
- `base`: the four base GEMMs (torch.mm), the floor;
- `lora`: base + our shrink and expand launches per projection, as decode graphs run them
  (`add_lora_triton` on the short tile list), 3 launches a projection;
- `n_concat`: the shrink rides the base GEMM (A's rows appended to the weight: one GEMM
  writes y and x @ A.T side by side), then the expand as one cuBLAS addmm into y's columns
  (B block-diagonal over the projection's modules), 2 launches a projection;
- `k_concat`: the shrink as a cuBLAS GEMM into the columns after x, then one GEMM of [x, s]
  by [W, scale B] (the expand rides the base GEMM; y stays contiguous), 2 launches.
Each variant's y is checked against float64 torch (base + delta) on the first layer.

    python -m bench.lora_layer_fusion --out bench/results/lora-layer-fusion-h200.json
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from bench import kernels_timing as timing
from bench.kernels_lora_grid import padded_meta
from bench.kernels_timing import DEVICE, graph_time_us
from bench.run_record import add_row, run_record
from slora_kernels.lora import DECODE_TILES, add_lora_triton
from slora_kernels.lora_meta import DECODE_BLOCK_M

HIDDEN, INTER = 4096, 11008
# (name, K, output size of each module): the 7B layer's fused projections.
PROJECTIONS: tuple[tuple[str, int, tuple[int, ...]], ...] = (
    ("qkv", HIDDEN, (HIDDEN, HIDDEN, HIDDEN)), ("o", HIDDEN, (HIDDEN,)),
    ("gate_up", HIDDEN, (INTER, INTER)), ("down", INTER, (HIDDEN,)))
CELLS: tuple[tuple[int, int], ...] = ((8, 64), (16, 64), (16, 256), (64, 64))
VARIANTS = ("base", "lora", "n_concat", "k_concat")


@dataclass
class Projection:
    """One projection's tensors for every variant (fp16), and its adapter in an arena."""

    x: torch.Tensor        # [T, K]
    w: torch.Tensor        # [N, K]
    y: torch.Tensor        # [T, N]
    a: torch.Tensor        # [mods * r, K] (each module's A stacked)
    b_diag: torch.Tensor   # [N, mods * r] block-diagonal, scale folded in
    w_n: torch.Tensor      # [N + mods * r, K] = [W; A]
    y_n: torch.Tensor      # [T, N + mods * r]
    w_k: torch.Tensor      # [N, K + mods * r] = [W, scale B]
    x_k: torch.Tensor      # [T, K + mods * r], x in the first K columns
    arena: torch.Tensor
    a_off: torch.Tensor
    b_off: torch.Tensor
    ranks: torch.Tensor
    scales: torch.Tensor
    slices: tuple[tuple[int, int], ...]


def build(k: int, outs: tuple[int, ...], t: int, rank: int, gen: torch.Generator
          ) -> Projection:
    dt, dev, mods, n = torch.float16, DEVICE, len(outs), sum(outs)
    scale = 2.0

    def rand(*shape: int, std: float = 1.0) -> torch.Tensor:
        return (torch.randn(*shape, generator=gen) * std).to(dev, dt)

    x, w = rand(t, k), rand(n, k, std=k ** -0.5)
    a = rand(mods * rank, k, std=k ** -0.5)
    bs = [rand(o, rank, std=0.05) for o in outs]
    b_diag = torch.zeros(n, mods * rank, dtype=dt, device=dev)
    starts = [sum(outs[:i]) for i in range(mods)]
    for i, (s, o) in enumerate(zip(starts, outs, strict=True)):
        b_diag[s:s + o, i * rank:(i + 1) * rank] = bs[i] * scale
    # The arena: each module's A (r x K) then B (N_m x r), at multiples of 8 elements.
    pieces, a_offs, b_offs, at = [], [], [], 0
    for i in range(mods):
        a_offs.append(at)
        pieces.append(a[i * rank:(i + 1) * rank].reshape(-1))
        at += rank * k
        b_offs.append(at)
        pieces.append(bs[i].reshape(-1))
        at += outs[i] * rank
    x_k = torch.zeros(t, k + mods * rank, dtype=dt, device=dev)
    x_k[:, :k] = x
    return Projection(
        x=x, w=w, y=torch.empty(t, n, dtype=dt, device=dev), a=a, b_diag=b_diag,
        w_n=torch.cat([w, a]), y_n=torch.empty(t, n + mods * rank, dtype=dt, device=dev),
        w_k=torch.cat([w, b_diag], dim=1), x_k=x_k, arena=torch.cat(pieces),
        a_off=torch.tensor([a_offs], dtype=torch.int64, device=dev),
        b_off=torch.tensor([b_offs], dtype=torch.int64, device=dev),
        ranks=torch.full((1, mods), rank, dtype=torch.int32, device=dev),
        scales=torch.full((1, mods), scale, dtype=torch.float32, device=dev),
        slices=tuple(zip(starts, outs, strict=True)))


def variant(name: str, p: Projection, meta: Any, rank: int) -> Callable[[], torch.Tensor]:
    """A call computing the projection's y (base + delta) the way `name` does; returns y."""
    n, k = p.w.shape
    mods = len(p.slices)
    if name == "base":
        return lambda: torch.mm(p.x, p.w.t(), out=p.y)
    if name == "lora":
        def lora() -> torch.Tensor:
            torch.mm(p.x, p.w.t(), out=p.y)
            add_lora_triton(p.y, p.x, p.arena, p.a_off, p.b_off, p.ranks, p.scales,
                            tuple(range(mods)), p.slices, meta, max_rank=rank,
                            tiles=DECODE_TILES)
            return p.y
        return lora
    if name == "n_concat":
        def n_concat() -> torch.Tensor:
            torch.mm(p.x, p.w_n.t(), out=p.y_n)
            y = p.y_n[:, :n]
            y.addmm_(p.y_n[:, n:], p.b_diag.t())
            return y
        return n_concat
    if name == "k_concat":
        def k_concat() -> torch.Tensor:
            torch.mm(p.x_k[:, :k], p.a.t(), out=p.x_k[:, k:])
            return torch.mm(p.x_k, p.w_k.t(), out=p.y)
        return k_concat
    raise ValueError(name)


def rel_err(p: Projection, got: torch.Tensor, delta: bool = True) -> float:
    """Against float64 torch: x @ W.T, plus the adapter's delta when `delta`."""
    x, w, a, b = (t.double() for t in (p.x, p.w, p.a, p.b_diag))
    ref = x @ w.T + (x @ a.T) @ b.T if delta else x @ w.T
    return float((got.double() - ref).norm() / ref.norm())


def run_cell(rank: int, t: int, layers: int) -> dict[str, Any]:
    gen = torch.Generator().manual_seed(rank * 1000 + t)
    sets = [[build(k, outs, t, rank, gen) for _, k, outs in PROJECTIONS] for _ in range(layers)]
    meta = padded_meta([0] * t, -(-t // DECODE_BLOCK_M))
    row: dict[str, Any] = {"rank": rank, "batch": t}
    for name in VARIANTS:
        calls = [variant(name, p, meta, rank) for layer in sets for p in layer]
        row[f"{name}_us"] = graph_time_us(calls, replays=10) * len(PROJECTIONS)  # per layer
        errs = [rel_err(p, variant(name, p, meta, rank)(), name != "base") for p in sets[0]]
        row[f"{name}_rel_err"] = max(errs)
    base = row["base_us"]
    for name in VARIANTS[1:]:
        row[f"{name}_added_us"] = row[f"{name}_us"] - base
        # What 32 such layers add to a decode step's base GEMMs, as a throughput ratio of
        # the GEMMs alone (the step has attention and norms too: the real ratio is higher).
        row[f"{name}_gemm_ratio"] = base / row[f"{name}_us"]
    del sets
    if DEVICE == "cuda":
        torch.cuda.empty_cache()
    return row


def main(argv: list[str] | None = None) -> int:
    global HIDDEN, INTER, PROJECTIONS
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default=None)
    ap.add_argument("--toy", action="store_true", help="CPU smoke sizes (hidden 64)")
    args = ap.parse_args(argv)
    cells, layers = CELLS, 2
    if args.toy:
        HIDDEN, INTER = 64, 96
        PROJECTIONS = (("qkv", 64, (64, 64, 64)), ("o", 64, (64,)), ("gate_up", 64, (96, 96)),
                       ("down", 96, (64,)))
        timing.MAX_ROTATION, cells, layers = 1, ((8, 16),), 1
    rows: list[dict[str, Any]] = []
    result = {**run_record(["bench.lora_layer_fusion", *(argv or sys.argv[1:])]),
              "dtype": "float16", "hidden": HIDDEN, "intermediate": INTER,
              "method": "*_us: one layer's four projections, median of 10 CUDA-graph replays "
              f"over {layers} layers' weights; rel_err: against float64 torch", "rows": rows}
    for rank, t in cells:
        add_row(args.out, result, rows, run_cell(rank, t, layers), len(cells), digits=4)
    return 0


if __name__ == "__main__":
    sys.exit(main())
