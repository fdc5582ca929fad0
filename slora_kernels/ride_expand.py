"""The sole-adapter ride's expand as a Triton launch (slora_core/lora_ride.py), for the
projections whose output no op fuses it into (o and down, read by the residual rms_norm):

    y[t, n] += sum_j s[t, j] * b_t[j, n]        s [T, K], b_t [K, N], K <= 256

the same sum cuBLAS's `y.addmm_(s, b_t)` makes, in one launch of 16-row programs (64 past
128 tokens) that each read their expand-matrix tile once. The ride's default
(SoleAdapterRide.triton_expands): launched plainly it beat the addmm in all four shapes of
bench.lora_layer_fusion on an H100 (`fused_ops_all_nopdl` against `fused_ops_nopdl`, +4.4
vs +5.8, +7.4 vs +9.2, +13.6 vs +16.0 and +10.3 vs +10.8 us a layer at rank 8, 16, 16 with
256 tokens and 64; lora-layer-fusion-ops-5be1284-h100.json). Launched as a programmatic
dependent of the projection GEMM (reading the expand matrix while the GEMM ends) it did less
well in all four shapes (+4.9, +7.7, +15.3, +11.0 us); that launch is gone, as from the
other ride kernels.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from slora_kernels.lora_common import check_expand_operands, dot_precision
from slora_kernels.lora_meta import RideBlocks, ride_blocks

MAX_K = 256


@triton.jit
def _expand_add_kernel(y_ptr, s_ptr, b_ptr, num_tokens, n, k, stride_y, stride_s, stride_b,
                       DOT_PRECISION: tl.constexpr, BLOCK_M: tl.constexpr,
                       BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    mask_m, mask_n, mask_k = rows < num_tokens, cols < n, offs_k < k
    rows64 = rows.to(tl.int64)
    b = tl.load(b_ptr + offs_k[:, None].to(tl.int64) * stride_b + cols[None, :],
                mask=mask_k[:, None] & mask_n[None, :], other=0.0)
    s = tl.load(s_ptr + rows64[:, None] * stride_s + offs_k[None, :],
                mask=mask_m[:, None] & mask_k[None, :], other=0.0)
    mask = mask_m[:, None] & mask_n[None, :]
    y_ptrs = y_ptr + rows64[:, None] * stride_y + cols[None, :]
    y = tl.load(y_ptrs, mask=mask, other=0.0)
    # One rounding to the output dtype, as the addmm's.
    out = y.to(tl.float32) + tl.dot(s, b, input_precision=DOT_PRECISION)
    tl.store(y_ptrs, out.to(y.dtype), mask=mask)


def expand_add_triton(y: torch.Tensor, s: torch.Tensor, b_t: torch.Tensor,
                      blocks: RideBlocks | None = None) -> torch.Tensor:
    """y += s @ b_t in place (y [T, N] and s [T, K] may be strided views, unit column stride;
    b_t [K, N]); returns y. `blocks`: the launch's shape (ride_blocks' by default)."""
    if y.dim() != 2 or s.dim() != 2 or y.stride(1) != 1:
        raise ValueError(f"y [T, N] and s [T, K] expected, y with unit column stride; got y "
                         f"{tuple(y.shape)}, s {tuple(s.shape)}")
    t, n = y.shape
    k = s.shape[1]
    if not 0 < k <= MAX_K:
        raise ValueError(f"K = {k}: the expand takes 0 < K <= {MAX_K}")
    check_expand_operands(s, b_t, t, k, n, y.dtype, "K")
    if t == 0:
        return y
    blocks = blocks or ride_blocks(t)
    block_n = 128
    _expand_add_kernel[(triton.cdiv(t, blocks.m), triton.cdiv(n, block_n))](
        y, s, b_t, t, n, k, y.stride(0), s.stride(0), b_t.stride(0),
        DOT_PRECISION=dot_precision(y.dtype), BLOCK_M=blocks.m,
        BLOCK_N=block_n, BLOCK_K=max(16, triton.next_power_of_2(k)), num_warps=blocks.warps)
    return y
