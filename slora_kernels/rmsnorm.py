"""Fused residual add + RMSNorm, one program per token.

    if residual: residual[t] += x[t]; h = residual[t]  else: h = x[t]
    y[t] = weight * (h / sqrt(mean(h^2) + eps)).to(dtype)

Shapes: x, residual, y [T, N] (unit stride along N), weight [N].
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _rms_norm_kernel(x_ptr, res_ptr, w_ptr, y_ptr, n_cols, stride_x, stride_r, stride_y, eps,
                     HAS_RESIDUAL: tl.constexpr, BLOCK_N: tl.constexpr):
    t = tl.program_id(0)
    offs = tl.arange(0, BLOCK_N)
    mask = offs < n_cols
    x = tl.load(x_ptr + t * stride_x + offs, mask=mask, other=0.0)
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
                    residual: torch.Tensor | None = None
                    ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Same contract as `fused_reference.rms_norm_reference`."""
    if x.dim() != 2 or x.stride(1) != 1 or weight.shape != (x.shape[1],):
        raise ValueError(f"x must be [T, N] with unit column stride and weight [N]; got "
                         f"{tuple(x.shape)}, {tuple(weight.shape)}")
    if residual is not None and (residual.shape != x.shape or residual.stride(1) != 1
                                 or residual.dtype != x.dtype):
        raise ValueError("residual must match x in shape, dtype and column stride")
    y = torch.empty_like(x)
    if x.shape[0] == 0:
        return y, residual
    block = triton.next_power_of_2(x.shape[1])
    res = residual if residual is not None else x
    _rms_norm_kernel[(x.shape[0],)](
        x, res, weight, y, x.shape[1], x.stride(0), res.stride(0), y.stride(0), eps,
        HAS_RESIDUAL=residual is not None, BLOCK_N=block, num_warps=min(16, max(1, block // 256)),
    )
    return y, residual
