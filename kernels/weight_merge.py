"""Fold one module's LoRA delta into 16-bit weight rows, check the round trip, take it out.

For a weight slice w [rows, k] (contiguous rows), A [r, k], B [rows, r] and a scale:

    d = scale * (B @ A)                              float32, from the 16-bit factors
    CHECK     mask[i, j] = round(round(w + d) - d) != w   (bit patterns; w untouched)
    ADD       w = round(w + d)
    SUBTRACT  w = round(w - d)

where round is to the weights' dtype, nearest even. The products of two 16-bit factors are
exact in float32 and each tile sums them in one fixed order, and the mode is a runtime
argument, so every mode runs the same compiled kernel and computes the same d bits: the CHECK
predicts exactly which elements a SUBTRACT after an ADD does not give back. One launch reads
w once (and writes it, or the int8 mask), where the torch version of a merge runs a dozen
float32 passes over each chunk of rows (slora_core.lora_merge, which calls this on CUDA).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

CHECK, ADD, SUBTRACT = 0, 1, 2
BLOCK_M = 64
BLOCK_N = 128


@triton.jit(do_not_specialize=["mode"])
def _merge_kernel(w_ptr, a_ptr, b_ptr, mask_ptr, rows, k, rank, scale, mode,
                  BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr):
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
        bad = back.to(tl.int16, bitcast=True) != w.to(tl.int16, bitcast=True)
        tl.store(mask_ptr + at, bad.to(tl.int8), mask=inside)
    elif mode == 1:
        tl.store(w_ptr + at, (w.to(tl.float32) + d).to(w.dtype), mask=inside)
    else:
        tl.store(w_ptr + at, (w.to(tl.float32) - d).to(w.dtype), mask=inside)


def merge_delta(w: torch.Tensor, a: torch.Tensor, b: torch.Tensor, scale: float, mode: int,
                mask: torch.Tensor | None = None) -> None:
    """Run `mode` (CHECK, ADD or SUBTRACT, see the module docstring) over the weight rows `w`;
    CHECK writes `mask` (int8, w's shape) and needs it."""
    if w.dtype not in (torch.float16, torch.bfloat16):
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
    if mode not in (CHECK, ADD, SUBTRACT):
        raise ValueError(f"mode must be CHECK, ADD or SUBTRACT, got {mode}")
    if mode == CHECK and (mask is None or mask.shape != w.shape or mask.dtype != torch.int8
                          or not mask.is_contiguous()):
        raise ValueError("CHECK writes a contiguous int8 mask shaped like w")
    if rows == 0 or k == 0 or rank == 0:
        if mask is not None:
            mask.zero_()
        return
    grid = (triton.cdiv(rows, BLOCK_M), triton.cdiv(k, BLOCK_N))
    if mask is None:  # never written; an int8 pointer keeps one compiled kernel for all modes
        mask = torch.empty(1, dtype=torch.int8, device=w.device)
    _merge_kernel[grid](w, a, b, mask, rows, k, rank, float(scale), mode, BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N,
                        BLOCK_R=max(16, triton.next_power_of_2(rank)))
