"""Fused residual add + RMSNorm, one program per token.

    if residual: residual[t] += x[t]; h = residual[t]  else: h = x[t]
    y[t] = weight * (h / sqrt(mean(h^2) + eps)).to(dtype)

Shapes: x, residual, y [T, N] (unit stride along N), weight [N].

With `expand` (s [T, K], b_t [K, N]: the sole-adapter ride's o or down projection, whose
expand the projection deferred, slora_core/lora_ride.py), x[t] += s[t] @ b_t first, rounded
once to the dtype as cuBLAS's `x.addmm_(s, b_t)` rounds it: one launch instead of the expand's
and the norm's. Each program reads all of b_t (K x N, from L2) as one tile, every load in
flight at once (a first version looped over b_t's rows, one L2 round trip each, and lost to
the separate expand: ca134db), so it is for small K and few tokens: the ride defers to it at
ranks up to lora_ride.NORM_EXPAND_MAX_ROWS and steps up to lora.NORM_EXPAND_MAX_TOKENS.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from slora_kernels.lora_common import check_expand_operands


@triton.jit
def _rms_norm_kernel(x_ptr, res_ptr, w_ptr, y_ptr, s_ptr, b_ptr, n_cols, k, stride_x, stride_r,
                     stride_y, stride_s, stride_b, eps, HAS_RESIDUAL: tl.constexpr,
                     HAS_EXPAND: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    t = tl.program_id(0)
    offs = tl.arange(0, BLOCK_N)
    mask = offs < n_cols
    x = tl.load(x_ptr + t * stride_x + offs, mask=mask, other=0.0)
    if HAS_EXPAND:
        offs_k = tl.arange(0, BLOCK_K)
        mask_k = offs_k < k
        s = tl.load(s_ptr + t.to(tl.int64) * stride_s + offs_k, mask=mask_k, other=0.0)
        b = tl.load(b_ptr + offs_k[:, None] * stride_b + offs[None, :],
                    mask=mask_k[:, None] & mask[None, :], other=0.0)
        delta = tl.sum(s.to(tl.float32)[:, None] * b.to(tl.float32), axis=0)
        x = (x.to(tl.float32) + delta).to(x.dtype)
    if HAS_RESIDUAL:
        r = tl.load(res_ptr + t * stride_r + offs, mask=mask, other=0.0)
        # Round the sum to the model dtype first, as an unfused `residual + x` would.
        x = (x.to(tl.float32) + r.to(tl.float32)).to(x.dtype)
        tl.store(res_ptr + t * stride_r + offs, x, mask=mask)
    h = x.to(tl.float32)
    rstd = 1.0 / tl.sqrt(tl.sum(h * h, axis=0) / n_cols + eps)
    normed = (h * rstd).to(x.dtype).to(tl.float32)
    w = tl.load(w_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    tl.store(y_ptr + t * stride_y + offs, (w * normed).to(y_ptr.dtype.element_ty), mask=mask)


def rms_norm_triton(x: torch.Tensor, weight: torch.Tensor, eps: float,
                    residual: torch.Tensor | None = None,
                    expand: tuple[torch.Tensor, torch.Tensor] | None = None
                    ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Same contract as `fused_reference.rms_norm_reference`; with `expand` = (s, b_t), x is
    first increased in place by s @ b_t (see the module docstring)."""
    if x.dim() != 2 or x.stride(1) != 1 or weight.shape != (x.shape[1],):
        raise ValueError(f"x must be [T, N] with unit column stride and weight [N]; got "
                         f"{tuple(x.shape)}, {tuple(weight.shape)}")
    if residual is not None and (residual.shape != x.shape or residual.stride(1) != 1
                                 or residual.dtype != x.dtype):
        raise ValueError("residual must match x in shape, dtype and column stride")
    s, b_t = expand if expand is not None else (x, x)
    k = s.shape[1] if expand is not None else 0
    if expand is not None:
        check_expand_operands(s, b_t, x.shape[0], k, x.shape[1], x.dtype, "K")
    y = torch.empty_like(x)
    if x.shape[0] == 0:
        return y, residual
    block = triton.next_power_of_2(x.shape[1])
    block_k = triton.next_power_of_2(max(k, 1))
    res = residual if residual is not None else x
    _rms_norm_kernel[(x.shape[0],)](
        x, res, weight, y, s, b_t, x.shape[1], k, x.stride(0), res.stride(0), y.stride(0),
        s.stride(0), b_t.stride(0), eps, HAS_RESIDUAL=residual is not None,
        HAS_EXPAND=expand is not None, BLOCK_N=block, BLOCK_K=block_k,
        # The expand's tile holds K values a column: more warps keep it in registers.
        num_warps=min(32, max(1, block // 256) * max(1, block_k // 8)),
    )
    return y, residual
