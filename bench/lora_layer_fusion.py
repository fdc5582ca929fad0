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
With the op that reads each output (rotary on qkv's, silu_mul on gate_up's; o's and down's
go to the residual rms_norm, left out as it is the same in all three):
- `base_ops`: the base GEMMs and those ops;
- `n_concat_ops`: n_concat and those ops, as the ride ran before the fusion;
- `fused_ops_nopdl`: n_concat with qkv's and gate_up's expands fused into those ops, 1
  launch a projection beyond base_ops for o and down (their addmm), none for qkv and
  gate_up;
- `fused_ops_all_nopdl`: fused_ops_nopdl with o's and down's expands a Triton launch behind
  their GEMM (slora_kernels.ride_expand) instead of the addmm: the engine's ride since
  5be1284 (SoleAdapterRide.triton_expands: it beat fused_ops_nopdl in all four shapes,
  lora-layer-fusion-ops-5be1284-h100.json).
Removed after they lost (their figures stay in the JSONs): `fused_ops` and `fused_ops_all`,
the same launched as programmatic dependents of the GEMM (PDL; in all four shapes at 3b09231
and 5be1284), and at 5be1284 o's and down's expands fused into the residual rms_norm (+6.5
vs +5.6 us a layer at rank 8, +16.3 vs +8.5 at 16). The `_nopdl` names are kept so that a
name means the same launches in every run.
Each variant's y is checked against float64 torch (base + delta) on the first layer; the
ops variants' outputs are checked against n_concat_ops'.

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
from slora_kernels.lora_meta import DECODE_BLOCK_M, RideBlocks, ride_blocks

HIDDEN, INTER = 4096, 11008
# (name, K, output size of each module): the 7B layer's fused projections.
PROJECTIONS: tuple[tuple[str, int, tuple[int, ...]], ...] = (
    ("qkv", HIDDEN, (HIDDEN, HIDDEN, HIDDEN)), ("o", HIDDEN, (HIDDEN,)),
    ("gate_up", HIDDEN, (INTER, INTER)), ("down", INTER, (HIDDEN,)))
CELLS: tuple[tuple[int, int], ...] = ((8, 64), (16, 64), (16, 256), (64, 64))
VARIANTS = ("base", "lora", "n_concat", "k_concat")
OPS_VARIANTS = ("base_ops", "n_concat_ops", "fused_ops_nopdl", "fused_ops_all_nopdl")
HEAD_DIM = 128


@dataclass
class Projection:
    """One projection's tensors for every variant (fp16), and its adapter in an arena."""

    kind: str              # PROJECTIONS' name: qkv, o, gate_up or down
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


def build(kind: str, k: int, outs: tuple[int, ...], t: int, rank: int, gen: torch.Generator
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
        kind=kind, x=x, w=w, y=torch.empty(t, n, dtype=dt, device=dev), a=a, b_diag=b_diag,
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
    if name in OPS_VARIANTS:
        return ops_variant(name, p, rank)
    raise ValueError(name)


def ops_variant(name: str, p: Projection, rank: int, blocks: RideBlocks | None = None
                ) -> Callable[[], torch.Tensor]:
    """A call computing what reads the projection: rotary's q, k, v for qkv, silu_mul's
    output for gate_up, y itself for o and down; returns it. `blocks`: the fused variants'
    expand launch shape (the engine's, lora_meta.ride_blocks, by default)."""
    from slora_kernels.rotary import rotary_expand_triton, rotary_triton
    from slora_kernels.silu_mul import silu_mul_expand_triton, silu_mul_triton

    n, t = p.w.shape[0], p.x.shape[0]
    mods = len(p.slices)
    b_t = p.b_diag.t().contiguous()  # the ride's layout (lora_ride.py)
    if name.startswith("fused_ops_all") and p.kind in ("o", "down"):
        from slora_kernels.ride_expand import expand_add_triton

        def gemm() -> torch.Tensor:
            torch.mm(p.x, p.w_n.t(), out=p.y_n)
            return expand_add_triton(p.y_n[:, :n], p.y_n[:, n:], b_t, blocks)
    elif name == "base_ops" or p.kind in ("o", "down"):
        gemm = variant("base" if name == "base_ops" else "n_concat", p, None, rank)
    else:
        def gemm() -> torch.Tensor:
            torch.mm(p.x, p.w_n.t(), out=p.y_n)
            return p.y_n[:, :n]
    fused = name.startswith("fused_ops")
    if p.kind == "gate_up":
        if fused:
            return lambda: silu_mul_expand_triton(gemm(), p.y_n[:, n:], b_t, rank, blocks)
        return lambda: silu_mul_triton(add_expand(name, p, gemm()))
    if p.kind == "qkv":
        heads = n // HEAD_DIM // mods
        cos = torch.ones(t, HEAD_DIM, dtype=p.x.dtype, device=p.x.device) * 0.6
        sin = torch.ones_like(cos) * 0.8

        def rotate() -> torch.Tensor:
            y = gemm()
            if fused:
                rotary_expand_triton(y, p.y_n[:, n:], b_t, rank, heads, heads, cos, sin,
                                     blocks)
            else:
                y = add_expand(name, p, y)
                q = y[:, : heads * HEAD_DIM].view(t, heads, HEAD_DIM)
                k = y[:, heads * HEAD_DIM : 2 * heads * HEAD_DIM].view(t, heads, HEAD_DIM)
                rotary_triton(q, k, cos, sin)
            return y

        return rotate
    return gemm


def add_expand(name: str, p: Projection, y: torch.Tensor) -> torch.Tensor:
    """n_concat_ops' addmm after the wide GEMM; base_ops has none."""
    if name == "base_ops":
        return y
    return y.addmm_(p.y_n[:, p.w.shape[0]:], p.b_diag.t())


def rel_err(p: Projection, got: torch.Tensor, delta: bool = True) -> float:
    """Against float64 torch: x @ W.T, plus the adapter's delta when `delta`."""
    x, w, a, b = (t.double() for t in (p.x, p.w, p.a, p.b_diag))
    ref = x @ w.T + (x @ a.T) @ b.T if delta else x @ w.T
    return float((got.double() - ref).norm() / ref.norm())


def run_cell(rank: int, t: int, layers: int, sweep: tuple[RideBlocks, ...] = ()
             ) -> dict[str, Any]:
    gen = torch.Generator().manual_seed(rank * 1000 + t)
    sets = [[build(kind, k, outs, t, rank, gen) for kind, k, outs in PROJECTIONS]
            for _ in range(layers)]
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
    for name in OPS_VARIANTS:
        calls = [ops_variant(name, p, rank) for layer in sets for p in layer]
        row[f"{name}_us"] = graph_time_us(calls, replays=10) * len(PROJECTIONS)
    for name in OPS_VARIANTS[1:]:
        row[f"{name}_added_us"] = row[f"{name}_us"] - row["base_ops_us"]
    # --sweep-blocks: fused_ops_all_nopdl with other expand launch shapes, checked against
    # the default's output and timed beside it.
    row["default_blocks"] = list(ride_blocks(t))
    for blocks in sweep:
        key = f"fused_ops_all_m{blocks.m}_w{blocks.warps}"
        calls = [ops_variant("fused_ops_all_nopdl", p, rank, blocks)
                 for layer in sets for p in layer]
        row[f"{key}_added_us"] = graph_time_us(calls, replays=10) * len(PROJECTIONS) \
            - row["base_ops_us"]
        row[f"{key}_rel_err"] = max(
            float((ops_variant("fused_ops_all_nopdl", p, rank, blocks)().double()
                   - ops_variant("fused_ops_all_nopdl", p, rank)().double()).norm()
                  / ops_variant("fused_ops_all_nopdl", p, rank)().double().norm())
            for p in sets[0])
    # The fused ops against the unfused ones, on the first layer's inputs.
    for name in OPS_VARIANTS[2:]:
        row[f"{name}_rel_err"] = max(
            float((ops_variant(name, p, rank)().double()
                   - ops_variant("n_concat_ops", p, rank)().double()).norm()
                  / ops_variant("n_concat_ops", p, rank)().double().norm()) for p in sets[0])
    del sets
    if DEVICE == "cuda":
        torch.cuda.empty_cache()
    return row


def cells_arg(text: str) -> tuple[tuple[int, int], ...]:
    """`--cells`: comma-separated RANKxTOKENS, each positive."""
    try:
        cells = tuple((int(r), int(t)) for r, t in (c.split("x") for c in text.split(",")))
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: RANKxTOKENS cells, e.g. 64x64,8x32"
                                         ) from None
    if not cells or any(r < 1 or t < 1 for r, t in cells):
        raise argparse.ArgumentTypeError(f"{text!r}: ranks and tokens must be positive")
    return cells


def blocks_arg(text: str) -> tuple[RideBlocks, ...]:
    """`--sweep-blocks`: comma-separated M/WARPS, M a power of two of at least 16 (a tl.dot's
    rows), WARPS one of 1, 2, 4, 8, 16 (may be empty)."""
    try:
        sweep = tuple(RideBlocks(*(int(v) for v in b.split("/", 1)))
                      for b in text.split(",") if b)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: M/WARPS pairs, e.g. 16/4,64/8") from None
    bad = [b for b in sweep if b.m < 16 or b.m & (b.m - 1) or b.warps not in (1, 2, 4, 8, 16)]
    if bad:
        raise argparse.ArgumentTypeError(
            f"{text!r}: M a power of two >= 16 and WARPS a power of two <= 16, not "
            + ", ".join(f"{b.m}/{b.warps}" for b in bad))
    return sweep


def main(argv: list[str] | None = None) -> int:
    global HIDDEN, INTER, PROJECTIONS, HEAD_DIM
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default=None)
    ap.add_argument("--toy", action="store_true", help="CPU smoke sizes (hidden 64)")
    ap.add_argument("--cells", type=cells_arg, default=None,
                    help="rank x tokens cells, e.g. 64x64,8x32 (default: "
                    + ",".join(f"{r}x{t}" for r, t in CELLS) + ")")
    ap.add_argument("--sweep-blocks", type=blocks_arg, default=(),
                    help="expand launch shapes to time beside the default, as M/WARPS pairs, "
                    "e.g. 16/4,32/4,64/4,64/8 (rows a program / warps)")
    args = ap.parse_args(argv)
    cells, layers, sweep = args.cells or CELLS, 2, args.sweep_blocks
    if args.toy:
        HIDDEN, INTER, HEAD_DIM = 64, 96, 16
        PROJECTIONS = (("qkv", 64, (64, 64, 64)), ("o", 64, (64,)), ("gate_up", 64, (96, 96)),
                       ("down", 96, (64,)))
        timing.MAX_ROTATION, layers = 1, 1
        cells = args.cells or ((8, 16),)
    rows: list[dict[str, Any]] = []
    result = {**run_record(["bench.lora_layer_fusion", *(argv or sys.argv[1:])]),
              "dtype": "float16", "hidden": HIDDEN, "intermediate": INTER,
              "method": "*_us: one layer's four projections, median of 10 CUDA-graph replays "
              f"over {layers} layers' weights; rel_err: against float64 torch", "rows": rows}
    for rank, t in cells:
        add_row(args.out, result, rows, run_cell(rank, t, layers, sweep), len(cells), digits=4)
    return 0


if __name__ == "__main__":
    sys.exit(main())
