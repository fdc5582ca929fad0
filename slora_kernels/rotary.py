"""Rotary embedding applied in place to q and k (rotate-half convention), one program per
token covering all of its q and k heads.

    x1, x2 = x[:D/2], x[D/2:];  x[:D/2] = x1*c - x2*s;  x[D/2:] = x2*c + x1*s

Shapes: q [T, H, D], k [T, Hkv, D] (strided views allowed, unit stride along D), cos/sin [T, D]
with each half repeated (HF layout); only the first half of each is read.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _rotate_heads(base_ptr, stride_h, num_heads, c, s, offs, HALF: tl.constexpr,
                  BLOCK_H: tl.constexpr):
    """Rotate heads [0, num_heads) of one token in place, BLOCK_H heads per tile."""
    for h0 in range(0, num_heads, BLOCK_H):
        heads = h0 + tl.arange(0, BLOCK_H)
        mask = (heads < num_heads)[:, None]
        ptrs = base_ptr + heads[:, None] * stride_h + offs[None, :]
        x1 = tl.load(ptrs, mask=mask)
        x2 = tl.load(ptrs + HALF, mask=mask)
        a, b = x1.to(tl.float32), x2.to(tl.float32)
        tl.store(ptrs, (a * c - b * s).to(x1.dtype), mask=mask)
        tl.store(ptrs + HALF, (b * c + a * s).to(x1.dtype), mask=mask)


@triton.jit
def _rotary_kernel(q_ptr, k_ptr, cos_ptr, sin_ptr, stride_qt, stride_qh, stride_kt, stride_kh,
                   stride_ct, num_q_heads, num_k_heads, HALF: tl.constexpr,
                   BLOCK_H: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, HALF)
    c = tl.load(cos_ptr + t * stride_ct + offs).to(tl.float32)[None, :]
    s = tl.load(sin_ptr + t * stride_ct + offs).to(tl.float32)[None, :]
    _rotate_heads(q_ptr + t * stride_qt, stride_qh, num_q_heads, c, s, offs, HALF, BLOCK_H)
    _rotate_heads(k_ptr + t * stride_kt, stride_kh, num_k_heads, c, s, offs, HALF, BLOCK_H)


def rotary_triton(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
                  ) -> None:
    """Same contract as `fused_reference.rotary_reference`."""
    if q.dim() != 3 or k.dim() != 3 or q.shape[2] != k.shape[2] or q.shape[0] != k.shape[0]:
        raise ValueError(f"q [T, H, D] and k [T, Hkv, D] expected; got {tuple(q.shape)}, "
                         f"{tuple(k.shape)}")
    d = q.shape[2]
    if d % 2 or triton.next_power_of_2(d // 2) != d // 2:
        raise ValueError(f"head_dim {d} must be twice a power of two")
    if q.stride(2) != 1 or k.stride(2) != 1 or cos.stride(-1) != 1 or cos.shape != sin.shape:
        raise ValueError("q, k, cos and sin need unit stride along the head dimension")
    if cos.shape != (q.shape[0], d) or cos.stride() != sin.stride():
        raise ValueError(f"cos/sin must be [T, D] = {(q.shape[0], d)}, got {tuple(cos.shape)}")
    if q.shape[0] == 0:
        return
    # One program per token: cos/sin are read once and every head's row is a wide tile.
    block_h = min(triton.next_power_of_2(max(q.shape[1], k.shape[1])), max(1, 4096 // d))
    _rotary_kernel[(q.shape[0],)](q, k, cos, sin, q.stride(0), q.stride(1), k.stride(0),
                                  k.stride(1), cos.stride(0), q.shape[1], k.shape[1],
                                  HALF=d // 2, BLOCK_H=block_h)
