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

from slora_kernels.lora_common import check_expand_operands, dot_precision
from slora_kernels.lora_meta import RideBlocks, ride_blocks


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


@triton.jit
def _rotary_expand_kernel(x_ptr, s_ptr, b_ptr, cos_ptr, sin_ptr, num_tokens, rank, num_q_heads,
                          num_kv_heads, stride_x, stride_s, stride_b, stride_ct,
                          DOT_PRECISION: tl.constexpr, HALF: tl.constexpr,
                          BLOCK_M: tl.constexpr, BLOCK_R: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    head = tl.program_id(1)  # over q heads, then k heads, then v heads
    module = (head >= num_q_heads).to(tl.int32) + (head >= num_q_heads + num_kv_heads).to(
        tl.int32)
    offs_r = tl.arange(0, BLOCK_R)
    offs_d = tl.arange(0, HALF)
    mask_m, mask_r = rows < num_tokens, offs_r < rank
    rows64 = rows.to(tl.int64)
    col = head * (2 * HALF)  # q, k and v heads lie side by side in the fused output
    b_rows = b_ptr + (module * rank + offs_r[:, None]).to(tl.int64) * stride_b + col + offs_d[
        None, :]
    b1 = tl.load(b_rows, mask=mask_r[:, None], other=0.0)
    b2 = tl.load(b_rows + HALF, mask=mask_r[:, None], other=0.0)
    s = tl.load(s_ptr + rows64[:, None] * stride_s + module * rank + offs_r[None, :],
                mask=mask_m[:, None] & mask_r[None, :], other=0.0)
    x_rows = x_ptr + rows64[:, None] * stride_x + col + offs_d[None, :]
    x1 = tl.load(x_rows, mask=mask_m[:, None], other=0.0)
    x2 = tl.load(x_rows + HALF, mask=mask_m[:, None], other=0.0)
    # Each half's sum rounded to the model dtype once, as the unfused addmm's output is.
    a = (x1.to(tl.float32) + tl.dot(s, b1, input_precision=DOT_PRECISION)).to(x1.dtype)
    b = (x2.to(tl.float32) + tl.dot(s, b2, input_precision=DOT_PRECISION)).to(x1.dtype)
    if module < 2:  # q or k: rotate
        cs_rows = rows64[:, None] * stride_ct + offs_d[None, :]
        c = tl.load(cos_ptr + cs_rows, mask=mask_m[:, None], other=0.0).to(tl.float32)
        sn = tl.load(sin_ptr + cs_rows, mask=mask_m[:, None], other=0.0).to(tl.float32)
        af, bf = a.to(tl.float32), b.to(tl.float32)
        a, b = (af * c - bf * sn).to(x1.dtype), (bf * c + af * sn).to(x1.dtype)
    tl.store(x_rows, a, mask=mask_m[:, None])
    tl.store(x_rows + HALF, b, mask=mask_m[:, None])


def rotary_expand_triton(qkv: torch.Tensor, s: torch.Tensor, b_t: torch.Tensor, rank: int,
                         num_q_heads: int, num_kv_heads: int, cos: torch.Tensor,
                         sin: torch.Tensor, blocks: RideBlocks | None = None) -> None:
    """qkv += s @ b_t, then q and k rotated, in place, in one launch (the sole-adapter ride's
    qkv projection, slora_core/lora_ride.py): qkv [T, (H + 2 Hkv) D] (q heads, k heads, v
    heads), s [T, 3 rank] (q's shrink, k's, v's), b_t [3 rank, (H + 2 Hkv) D]
    block-diagonal. Same result as `qkv.addmm_(s, b_t)` then `rotary_triton` on q and k, up
    to the dot's summation order."""
    if qkv.dim() != 2 or qkv.stride(1) != 1 or cos.dim() != 2:
        raise ValueError(f"qkv must be [T, (H + 2 Hkv) D] with unit column stride and cos/sin "
                         f"[T, D]; got {tuple(qkv.shape)}, {tuple(cos.shape)}")
    t, width = qkv.shape
    heads = num_q_heads + 2 * num_kv_heads
    d = cos.shape[1]
    if width != heads * d or d % 2 or triton.next_power_of_2(d // 2) != d // 2:
        raise ValueError(f"qkv's {width} columns are not {heads} heads of {d} (twice a power "
                         "of two)")
    if cos.shape != (t, d) or cos.stride() != sin.stride() or cos.stride(1) != 1 \
            or sin.shape != cos.shape:
        raise ValueError(f"cos/sin must be [T, D] = {(t, d)} with unit stride along D, got "
                         f"{tuple(cos.shape)}")
    check_expand_operands(s, b_t, t, 3 * rank, width, qkv.dtype, "3 rank")
    if t == 0:
        return
    blocks = blocks or ride_blocks(t)
    _rotary_expand_kernel[(triton.cdiv(t, blocks.m), heads)](
        qkv, s, b_t, cos, sin, t, rank, num_q_heads, num_kv_heads, qkv.stride(0), s.stride(0),
        b_t.stride(0), cos.stride(0),
        DOT_PRECISION=dot_precision(qkv.dtype), HALF=d // 2,
        BLOCK_M=blocks.m, BLOCK_R=max(16, triton.next_power_of_2(rank)), num_warps=blocks.warps)
