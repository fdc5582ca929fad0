"""Fused small ops (RMSNorm + residual, rotary, SiLU-and-multiply) against float64 torch and
against the dtype-faithful references the CPU path uses."""

from __future__ import annotations

import pytest
import torch

from slora_kernels.fused_reference import rms_norm_reference, rotary_reference, silu_mul_reference
from slora_kernels.rmsnorm import rms_norm_triton
from slora_kernels.rotary import rotary_triton
from slora_kernels.silu_mul import silu_mul_triton
from tests.kernel_tests.helpers import DEVICE, DTYPES, TOLERANCE, generator, randn, rel_err


def _rms64(h: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    h = h.double()
    return w.double() * h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("tokens,hidden", [(1, 64), (7, 96), (33, 256)])
def test_rms_norm_with_and_without_residual(dtype, tokens, hidden):
    gen = generator(tokens * hidden)
    x = randn(tokens, hidden, dtype=dtype, gen=gen)
    res = randn(tokens, hidden, dtype=dtype, gen=gen)
    w = randn(hidden, dtype=dtype, gen=gen)
    y, _ = rms_norm_triton(x, w, 1e-5)
    assert rel_err(y, _rms64(x, w, 1e-5)) < TOLERANCE[dtype]
    y_ref, _ = rms_norm_reference(x, w, 1e-5)
    assert rel_err(y, y_ref) < TOLERANCE[dtype]
    res_t, res_r = res.clone(), res.clone()
    y, out_res = rms_norm_triton(x, w, 1e-5, residual=res_t)
    y_ref, _ = rms_norm_reference(x, w, 1e-5, residual=res_r)
    assert out_res is res_t
    assert torch.equal(res_t, res_r)  # the sum is rounded to the dtype exactly as torch does
    assert rel_err(y, _rms64(x.double() + res.double(), w, 1e-5)) < TOLERANCE[dtype]
    assert rel_err(y, y_ref) < TOLERANCE[dtype]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("heads,kv_heads,head_dim", [(4, 2, 16), (8, 8, 32), (6, 1, 64)])
def test_rotary_in_place_on_strided_views(dtype, heads, kv_heads, head_dim):
    tokens = 9
    gen = generator(heads * head_dim)
    qkv = randn(tokens, (heads + 2 * kv_heads) * head_dim, dtype=dtype, gen=gen)
    q = qkv[:, : heads * head_dim].view(tokens, heads, head_dim)
    k = qkv[:, heads * head_dim : (heads + kv_heads) * head_dim].view(tokens, kv_heads, head_dim)
    v_before = qkv[:, (heads + kv_heads) * head_dim :].clone()
    pos = torch.arange(100, 100 + tokens, dtype=torch.float64)
    inv = 1.0 / 10000 ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim)
    ang = torch.cat((pos[:, None] * inv, pos[:, None] * inv), dim=-1)
    cos, sin = ang.cos().to(DEVICE, dtype), ang.sin().to(DEVICE, dtype)
    q64 = q.double().clone()
    k64 = k.double().clone()
    rotary_reference(q64, k64, cos.double(), sin.double())
    qr, kr = q.clone(), k.clone()
    rotary_reference(qr, kr, cos, sin)
    rotary_triton(q, k, cos, sin)
    assert rel_err(q, q64) < TOLERANCE[dtype] and rel_err(k, k64) < TOLERANCE[dtype]
    assert rel_err(q, qr) < TOLERANCE[dtype] and rel_err(k, kr) < TOLERANCE[dtype]
    assert torch.equal(qkv[:, (heads + kv_heads) * head_dim :], v_before)  # v untouched


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("tokens,inter", [(1, 48), (5, 1500), (16, 128)])
def test_silu_mul(dtype, tokens, inter):
    gate_up = randn(tokens, 2 * inter, dtype=dtype, gen=generator(inter), std=3.0)
    out = silu_mul_triton(gate_up)
    g, u = gate_up.double().chunk(2, dim=-1)
    assert rel_err(out, torch.nn.functional.silu(g) * u) < TOLERANCE[dtype]
    assert rel_err(out, silu_mul_reference(gate_up)) < TOLERANCE[dtype]


def test_bad_inputs_are_refused():
    x = torch.zeros(4, 8, device=DEVICE)
    with pytest.raises(ValueError, match="weight"):
        rms_norm_triton(x, torch.zeros(7, device=DEVICE), 1e-5)
    with pytest.raises(ValueError, match="2I"):
        silu_mul_triton(torch.zeros(4, 7, device=DEVICE))
    with pytest.raises(ValueError, match="head_dim"):
        q = torch.zeros(2, 2, 12, device=DEVICE)
        rotary_triton(q, q, torch.zeros(2, 12, device=DEVICE), torch.zeros(2, 12, device=DEVICE))
