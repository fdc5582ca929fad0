"""Write new keys and values into the KV pages of the arena.

Semantics (as `attention_reference.write_kv_reference`): for every token t with
slot = slot_mapping[t] >= 0,

    k_cache[slot // block_size, slot % block_size] = k[t]      (and likewise v)

Shapes: k, v [T, Hkv, D] (any token/head strides, unit stride along D); k_cache, v_cache
[num_pages, block_size, Hkv, D] strided views of the arena (unit stride along D);
slot_mapping [T] int64.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _write_kv_kernel(
    k_ptr, v_ptr, k_cache_ptr, v_cache_ptr, slot_ptr,
    num_kv_heads, stride_kt, stride_kh, stride_vt, stride_vh,
    stride_kcp, stride_kcr, stride_kch, stride_vcp, stride_vcr, stride_vch,
    BLOCK_SIZE: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_H: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_ptr + t)
    if slot < 0:
        return
    page = slot // BLOCK_SIZE
    row = slot % BLOCK_SIZE
    offs_h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, HEAD_DIM)
    mask = (offs_h < num_kv_heads)[:, None]
    k = tl.load(k_ptr + t * stride_kt + offs_h[:, None] * stride_kh + offs_d[None, :], mask=mask)
    v = tl.load(v_ptr + t * stride_vt + offs_h[:, None] * stride_vh + offs_d[None, :], mask=mask)
    k_dst = k_cache_ptr + page * stride_kcp + row * stride_kcr + offs_h[:, None] * stride_kch
    v_dst = v_cache_ptr + page * stride_vcp + row * stride_vcr + offs_h[:, None] * stride_vch
    tl.store(k_dst + offs_d[None, :], k.to(k_cache_ptr.dtype.element_ty), mask=mask)
    tl.store(v_dst + offs_d[None, :], v.to(v_cache_ptr.dtype.element_ty), mask=mask)


def write_kv_triton(
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Scatter k and v rows into their arena slots (see module docstring)."""
    _check(k_cache, v_cache, k, v, slot_mapping)
    num_tokens, num_kv_heads, head_dim = k.shape
    if num_tokens == 0:
        return
    # About 4096 elements per program: one token of a 7B-class model's K and V.
    block_h = min(triton.next_power_of_2(num_kv_heads), max(1, 4096 // head_dim))
    grid = (num_tokens, triton.cdiv(num_kv_heads, block_h))
    _write_kv_kernel[grid](
        k, v, k_cache, v_cache, slot_mapping,
        num_kv_heads, k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        BLOCK_SIZE=k_cache.shape[1], HEAD_DIM=head_dim, BLOCK_H=block_h,
    )


def _check(k_cache: torch.Tensor, v_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
           slot_mapping: torch.Tensor) -> None:
    if k.shape != v.shape or k.dim() != 3:
        raise ValueError(f"k and v must both be [T, Hkv, D], got {tuple(k.shape)} and "
                         f"{tuple(v.shape)}")
    if k_cache.shape != v_cache.shape or k_cache.shape[2:] != k.shape[1:]:
        raise ValueError(f"caches {tuple(k_cache.shape)} do not hold rows of {tuple(k.shape)}")
    if any(t.stride(-1) != 1 for t in (k, v, k_cache, v_cache)):
        raise ValueError("k, v and the caches need unit stride along head_dim")
    if slot_mapping.shape != (k.shape[0],) or slot_mapping.dtype != torch.int64:
        raise ValueError("slot_mapping must be int64 [T]")
    if triton.next_power_of_2(k.shape[2]) != k.shape[2]:
        raise ValueError(f"head_dim {k.shape[2]} must be a power of two")
