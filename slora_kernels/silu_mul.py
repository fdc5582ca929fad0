"""SiLU-and-multiply over the fused gate/up projection output.

    out[t, i] = silu(gate_up[t, i]).to(dtype) * gate_up[t, I + i]

Shapes: gate_up [T, 2I] (unit column stride), out [T, I].
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from slora_kernels.lora_common import check_expand_operands, dot_precision
from slora_kernels.lora_meta import RideBlocks, ride_blocks

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


@triton.jit
def _silu_mul_expand_kernel(x_ptr, s_ptr, b_ptr, y_ptr, num_tokens, inter, rank, stride_x,
                            stride_s, stride_b, stride_y, DOT_PRECISION: tl.constexpr,
                            BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                            BLOCK_R: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_r = tl.arange(0, BLOCK_R)
    mask_m, mask_n, mask_r = rows < num_tokens, cols < inter, offs_r < rank
    rows64 = rows.to(tl.int64)
    s_mask = mask_m[:, None] & mask_r[None, :]
    b_mask = mask_r[:, None] & mask_n[None, :]
    s_rows = s_ptr + rows64[:, None] * stride_s + offs_r[None, :]
    b_rows = b_ptr + offs_r[:, None].to(tl.int64) * stride_b + cols[None, :]
    # Gate: s[:, :rank] @ b_t[:rank, :I]; up: s[:, rank:2 rank] @ b_t[rank:2 rank, I:].
    b_g = tl.load(b_rows, mask=b_mask, other=0.0)
    b_u = tl.load(b_rows + rank * stride_b + inter, mask=b_mask, other=0.0)
    s_g = tl.load(s_rows, mask=s_mask, other=0.0)
    s_u = tl.load(s_rows + rank, mask=s_mask, other=0.0)
    mask = mask_m[:, None] & mask_n[None, :]
    x_rows = x_ptr + rows64[:, None] * stride_x + cols[None, :]
    g = tl.load(x_rows, mask=mask, other=0.0)
    u = tl.load(x_rows + inter, mask=mask, other=0.0)
    # Each sum rounded to the model dtype once, as the unfused addmm's output is.
    gf = (g.to(tl.float32) + tl.dot(s_g, b_g, input_precision=DOT_PRECISION)
          ).to(g.dtype).to(tl.float32)
    uf = (u.to(tl.float32) + tl.dot(s_u, b_u, input_precision=DOT_PRECISION)
          ).to(g.dtype).to(tl.float32)
    act = (gf / (1.0 + tl.exp(-gf))).to(g.dtype).to(tl.float32)
    tl.store(y_ptr + rows64[:, None] * stride_y + cols[None, :], (act * uf).to(g.dtype),
             mask=mask)


def silu_mul_expand_triton(gate_up: torch.Tensor, s: torch.Tensor, b_t: torch.Tensor,
                           rank: int, blocks: RideBlocks | None = None) -> torch.Tensor:
    """silu_mul of gate_up + s @ b_t, with the expand fused in (the sole-adapter ride's
    gate_up projection, slora_core/lora_ride.py): s [T, 2 rank] (gate's shrink, then up's),
    b_t [2 rank, 2I] block-diagonal (gate's rows over the first I columns, up's over the
    rest). Same result as `gate_up.addmm_(s, b_t)` then `silu_mul_triton`, up to the dot's
    summation order; gate_up is not written. Launched plainly: as a programmatic dependent
    of the GEMM (b_t read while the GEMM ends) it lost 0.1-1.0 us a layer in every shape
    measured on an H100 (lora-layer-fusion-ops-3b09231-h100.json, -5be1284-h100.json), and
    that launch is gone."""
    if gate_up.dim() != 2 or gate_up.shape[1] % 2 or gate_up.stride(1) != 1:
        raise ValueError(f"gate_up must be [T, 2I] with unit column stride, got "
                         f"{tuple(gate_up.shape)}")
    t, two_i = gate_up.shape
    check_expand_operands(s, b_t, t, 2 * rank, two_i, gate_up.dtype, "2 rank")
    inter = two_i // 2
    out = torch.empty(t, inter, dtype=gate_up.dtype, device=gate_up.device)
    if t == 0:
        return out
    blocks = blocks or ride_blocks(t)
    block_n = 64
    _silu_mul_expand_kernel[(triton.cdiv(t, blocks.m), triton.cdiv(inter, block_n))](
        gate_up, s, b_t, out, t, inter, rank, gate_up.stride(0), s.stride(0), b_t.stride(0),
        out.stride(0), DOT_PRECISION=dot_precision(gate_up.dtype),
        BLOCK_M=blocks.m, BLOCK_N=block_n, BLOCK_R=max(16, triton.next_power_of_2(rank)),
        num_warps=blocks.warps)
    return out
