"""SiLU-and-multiply over the fused gate/up projection output.

    out[t, i] = silu(gate_up[t, i]).to(dtype) * gate_up[t, I + i]

Shapes: gate_up [T, 2I] (unit column stride), out [T, I].
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK = 1024


@triton.jit
def _silu_mul_kernel(x_ptr, y_ptr, inter, stride_x, stride_y, BLOCK_N: tl.constexpr):
    t = tl.program_id(0)
    offs = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask = offs < inter
    g = tl.load(x_ptr + t * stride_x + offs, mask=mask, other=0.0)
    u = tl.load(x_ptr + t * stride_x + inter + offs, mask=mask, other=0.0)
    gf = g.to(tl.float32)
    # Round silu to the model dtype before the product, as the unfused torch code does.
    act = (gf / (1.0 + tl.exp(-gf))).to(g.dtype).to(tl.float32)
    tl.store(y_ptr + t * stride_y + offs, (act * u.to(tl.float32)).to(g.dtype), mask=mask)


def silu_mul_triton(gate_up: torch.Tensor) -> torch.Tensor:
    """Same contract as `fused_reference.silu_mul_reference`."""
    if gate_up.dim() != 2 or gate_up.shape[1] % 2 or gate_up.stride(1) != 1:
        raise ValueError(f"gate_up must be [T, 2I] with unit column stride, got "
                         f"{tuple(gate_up.shape)}")
    inter = gate_up.shape[1] // 2
    out = torch.empty(gate_up.shape[0], inter, dtype=gate_up.dtype, device=gate_up.device)
    if gate_up.shape[0] == 0:
        return out
    block = min(BLOCK, triton.next_power_of_2(inter))
    _silu_mul_kernel[(gate_up.shape[0], triton.cdiv(inter, block))](
        gate_up, out, inter, gate_up.stride(0), out.stride(0), BLOCK_N=block)
    return out
