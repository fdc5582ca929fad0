"""Fold one module's LoRA delta into 16-bit weight rows, check the round trip, take it out.

For a weight slice w [rows, k] (contiguous rows), A [r, k], B [rows, r] and a scale:

    d = scale * (B @ A)                              float32, from the 16-bit factors
    CHECK     the elements where round(round(w + d) - d) != w (bit patterns), compacted:
              their flat positions and original values appended to `positions` / `values`
              at a device counter (in no particular order); w untouched
    ADD       w = round(w + d)
    SUBTRACT  w = round(w - d)

where round is to the weights' dtype, nearest even. The products of two 16-bit factors are
exact in float32 and each tile sums them in one fixed order, and the mode is a runtime
argument, so every mode runs the same compiled kernel and computes the same d bits: the CHECK
finds exactly the elements a SUBTRACT after an ADD does not give back. Past the buffers'
capacity the CHECK only counts, so the caller sees the count pass the capacity and nothing is
written out of bounds. One launch reads w once (and writes it, or the few exceptions), where
the torch version of a merge runs a dozen float32 passes over each chunk of rows and a
nonzero over a mask (slora_core.lora_merge, which calls this on CUDA).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

CHECK, ADD, SUBTRACT = 0, 1, 2
# The weight dtypes the kernel merges (float32 weights need float64 sums, which tl.dot lacks).
DTYPES = (torch.float16, torch.bfloat16)
BLOCK_M = 64
BLOCK_N = 128


# Only the dtype and the rank tile pick a compiled variant (sizes are never specialized on), so
# `warm_up` can compile every variant a model will need before it serves.
@triton.jit(do_not_specialize=["mode", "capacity", "rows", "k", "rank"])
def _merge_kernel(w_ptr, a_ptr, b_ptr, pos_ptr, val_ptr, count_ptr, capacity, rows, k, rank,
                  scale, mode, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                  BLOCK_R: tl.constexpr):
    offs_m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_r = tl.arange(0, BLOCK_R)
    mask_m = offs_m < rows
    mask_n = offs_n < k
    mask_r = offs_r < rank
    b = tl.load(b_ptr + offs_m[:, None].to(tl.int64) * rank + offs_r[None, :],
                mask=mask_m[:, None] & mask_r[None, :], other=0.0)
    a = tl.load(a_ptr + offs_r[:, None].to(tl.int64) * k + offs_n[None, :],
                mask=mask_r[:, None] & mask_n[None, :], other=0.0)
    d = tl.dot(b, a) * scale
    at = offs_m[:, None].to(tl.int64) * k + offs_n[None, :]
    inside = mask_m[:, None] & mask_n[None, :]
    w = tl.load(w_ptr + at, mask=inside, other=0.0)
    if mode == 0:
        merged = (w.to(tl.float32) + d).to(w.dtype)
        back = (merged.to(tl.float32) - d).to(w.dtype)
        bad = (back.to(tl.int16, bitcast=True) != w.to(tl.int16, bitcast=True)) & inside
        flat = tl.reshape(bad.to(tl.int32), [BLOCK_M * BLOCK_N])
        n = tl.sum(flat, 0)
        if n > 0:
            # This tile's exceptions go to [base, base + n) of the buffers, in tile order.
            base = tl.atomic_add(count_ptr, n)
            slot = base + tl.cumsum(flat, 0) - 1
            keep = (flat != 0) & (slot < capacity)
            tl.store(pos_ptr + slot, tl.reshape(at, [BLOCK_M * BLOCK_N]).to(tl.int32),
                     mask=keep)
            tl.store(val_ptr + slot, tl.reshape(w, [BLOCK_M * BLOCK_N]), mask=keep)
    elif mode == 1:
        tl.store(w_ptr + at, (w.to(tl.float32) + d).to(w.dtype), mask=inside)
    else:
        tl.store(w_ptr + at, (w.to(tl.float32) - d).to(w.dtype), mask=inside)


def rank_tile(rank: int) -> int:
    """The rank tile (a compiled variant) a delta of this rank runs."""
    return max(16, triton.next_power_of_2(rank))


def warm_up(dtype: torch.dtype, max_rank: int, device: torch.device) -> None:
    """Compile the variants deltas of rank <= max_rank run (one a rank tile), on tiny inputs:
    a first compile mid-serving stalls a step for a second or more."""
    tile = 16
    while True:
        w = torch.zeros(16, 16, dtype=dtype, device=device)
        a = torch.zeros(tile, 16, dtype=dtype, device=device)
        b = torch.zeros(16, tile, dtype=dtype, device=device)
        check_round_trip(w, a, b, 1.0, capacity=16)
        merge_delta(w, a, b, 1.0, ADD)
        if tile >= rank_tile(max_rank):
            return
        tile *= 2


def merge_delta(w: torch.Tensor, a: torch.Tensor, b: torch.Tensor, scale: float,
                mode: int) -> None:
    """ADD the delta to the weight rows `w` or SUBTRACT it (see the module docstring)."""
    if mode not in (ADD, SUBTRACT):
        raise ValueError(f"mode must be ADD or SUBTRACT (check_round_trip does CHECK), got "
                         f"{mode}")
    _launch(w, a, b, scale, mode, None)


def check_round_trip(w: torch.Tensor, a: torch.Tensor, b: torch.Tensor, scale: float,
                     capacity: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The elements of `w` an ADD then a SUBTRACT of this delta would not give back:
    (positions int32 [capacity], values [capacity], count int32 [1]), all on w's device and
    filled asynchronously; the first min(count, capacity) entries hold flat positions in w
    and w's values there. A count above `capacity` means some were not stored."""
    if capacity < 0:
        raise ValueError(f"capacity must be >= 0, got {capacity}")
    positions = torch.empty(capacity, dtype=torch.int32, device=w.device)
    values = torch.empty(capacity, dtype=w.dtype, device=w.device)
    count = torch.zeros(1, dtype=torch.int32, device=w.device)
    _launch(w, a, b, scale, CHECK, (positions, values, count))
    return positions, values, count


def _launch(w: torch.Tensor, a: torch.Tensor, b: torch.Tensor, scale: float, mode: int,
            out: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None) -> None:
    if w.dtype not in DTYPES:
        raise ValueError(f"16-bit weights only (float16, bfloat16), got {w.dtype}")
    if w.dim() != 2 or not w.is_contiguous():
        raise ValueError(f"w must be contiguous 2-D rows, got {tuple(w.shape)}")
    rows, k = w.shape
    rank = a.shape[0]
    if (a.shape != (rank, k) or b.shape != (rows, rank) or a.dtype != w.dtype
            or b.dtype != w.dtype or not a.is_contiguous() or not b.is_contiguous()):
        raise ValueError(f"A {tuple(a.shape)} {a.dtype} and B {tuple(b.shape)} {b.dtype} do "
                         f"not factor {w.dtype} rows {tuple(w.shape)} (contiguous [r, k] and "
                         "[rows, r])")
    if rows * k >= 2**31:
        raise ValueError(f"{rows} x {k} weights: positions are int32")
    if rows == 0 or k == 0 or rank == 0:
        return
    # ADD and SUBTRACT pass empty buffers: the same argument types, so one compiled kernel.
    positions, values, count = out if out is not None else (
        torch.empty(0, dtype=torch.int32, device=w.device),
        torch.empty(0, dtype=w.dtype, device=w.device),
        torch.zeros(1, dtype=torch.int32, device=w.device))
    grid = (triton.cdiv(rows, BLOCK_M), triton.cdiv(k, BLOCK_N))
    _merge_kernel[grid](w, a, b, positions, values, count, positions.numel(), rows, k, rank,
                        float(scale), mode, BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N,
                        BLOCK_R=rank_tile(rank))
