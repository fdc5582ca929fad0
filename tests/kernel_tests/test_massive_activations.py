"""The Triton kernels on inputs with "massive activations" (a few channels at 1e4-3e4, as real
Llama-2/3 checkpoints have): every result that fits the model dtype in exact arithmetic must
come out finite and as accurate as on ordinary inputs. Intermediates may exceed the 16-bit
range (x @ A.T of a LoRA shrink, attention scores), as they do in peft (which keeps adapters in
float32 for 16-bit models) and in SDPA; the kernels keep those in float32."""

from __future__ import annotations

import math

import pytest
import torch

from slora_kernels.attention_reference import paged_attention_reference
from slora_kernels.lora import add_lora_triton
from slora_kernels.lora_reference import add_lora_reference
from slora_kernels.paged_attention import paged_attention_triton
from slora_kernels.rmsnorm import rms_norm_triton
from slora_kernels.rotary import rotary_triton
from slora_kernels.silu_mul import silu_mul_triton
from tests.kernel_tests.helpers import DEVICE, DTYPES, TOLERANCE, build_lora_case, generator, randn
from tests.kernel_tests.helpers import rel_err as _rel_err
from tests.kernel_tests.test_paged_attention import build_case

MASSIVE = (5, 77, 100)  # channels


def _massive(t: torch.Tensor, value: float, gen: torch.Generator) -> torch.Tensor:
    """Set channels MASSIVE (modulo the width) of every row to +-value."""
    signs = torch.where(torch.rand(t.shape[0], len(MASSIVE), generator=gen) < 0.5, -1.0, 1.0)
    t[:, [c % t.shape[1] for c in MASSIVE]] = (signs * value).to(t.device, t.dtype)
    return t


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    assert bool(torch.isfinite(out).all()), "a finite result came out NaN or inf"
    return _rel_err(out, ref)


@pytest.mark.parametrize("dtype", DTYPES)
def test_residual_rmsnorm_with_massive_channels(dtype: torch.dtype) -> None:
    gen = generator(1)
    x = _massive(randn(9, 128, dtype=dtype, gen=gen), 3e4, gen)
    res = _massive(randn(9, 128, dtype=dtype, gen=gen), 2e4, gen)
    w = 1 + 0.1 * randn(128, dtype=dtype, gen=gen)
    s = x.double() + res.double()  # |s| <= 5e4 < fp16 max, but s^2 and its mean are not
    ref = w.double() * s * torch.rsqrt(s.pow(2).mean(-1, keepdim=True) + 1e-5)
    y, _ = rms_norm_triton(x, w, 1e-5, residual=res)
    assert rel_err(y, ref) < TOLERANCE[dtype]


@pytest.mark.parametrize("dtype", DTYPES)
def test_rotary_with_massive_channels(dtype: torch.dtype) -> None:
    gen = generator(2)
    q = _massive(randn(6, 2 * 64, dtype=dtype, gen=gen), 3e4, gen).view(6, 2, 64)
    k = _massive(randn(6, 64, dtype=dtype, gen=gen), 3e4, gen).view(6, 1, 64)
    ang = torch.arange(6, dtype=torch.float64)[:, None] * 977.0 * torch.rand(32, generator=gen,
                                                                               dtype=torch.float64)
    ang = torch.cat([ang, ang], dim=-1).to(DEVICE)
    cos, sin = ang.cos().to(dtype), ang.sin().to(dtype)

    def ref(t: torch.Tensor) -> torch.Tensor:
        t = t.double()
        rot = torch.cat((-t[..., 32:], t[..., :32]), dim=-1)
        return t * cos.double()[:, None] + rot * sin.double()[:, None]

    want_q, want_k = ref(q), ref(k)
    rotary_triton(q, k, cos, sin)
    assert rel_err(q, want_q) < TOLERANCE[dtype] and rel_err(k, want_k) < TOLERANCE[dtype]


@pytest.mark.parametrize("dtype", DTYPES)
def test_silu_mul_with_large_gate_and_up(dtype: torch.dtype) -> None:
    gen = generator(3)
    gate = randn(5, 96, dtype=dtype, gen=gen, std=8.0)
    up = _massive(randn(5, 96, dtype=dtype, gen=gen), 2e3, gen)
    gu = torch.cat([gate, up], dim=-1)
    ref = torch.nn.functional.silu(gate.double()) * up.double()
    assert rel_err(silu_mul_triton(gu), ref) < TOLERANCE[dtype]


@pytest.mark.parametrize("dtype", DTYPES)
def test_lora_shrink_beyond_16_bit_range_with_rslora_scale(dtype: torch.dtype) -> None:
    """x @ A.T reaches ~2e5 (past fp16's 65504) on massive input channels, B brings the delta
    back to ~1e2 and an rsLoRA scale (alpha 64 / sqrt(32)) multiplies it: peft keeps such a
    chain in float32, so must we."""
    gen = generator(4)
    k, n, r = 128, 64, 32
    slots = [0] * 5 + [1] * 3
    case = build_lora_case(slots, 2, k, {6: n}, {(0, 6): r, (1, 6): r}, dtype, gen,
                           aligned=True)
    for slot in (0, 1):
        a0, b0 = int(case.a_offsets[slot, 6]), int(case.b_offsets[slot, 6])
        # Every rank row reads the massive channels; B is small, as trained B matrices are.
        case.arena[a0 : a0 + r * k].view(r, k)[:, list(MASSIVE)] = 2.0
        case.arena[b0 : b0 + n * r] *= 1e-3
    a0 = int(case.a_offsets[0, 6])
    a = case.arena[a0 : a0 + r * k].view(r, k)
    case.scales[:, 6] = 64 / math.sqrt(r)
    x = _massive(randn(len(slots), k, dtype=dtype, gen=gen), 3e4, gen)
    y0 = randn(len(slots), n, dtype=dtype, gen=gen)
    args = (case.arena, case.a_offsets, case.b_offsets, case.ranks, case.scales, (6,),
            ((0, n),), case.meta)
    ref = y0.double()
    add_lora_reference(ref, x.double(), case.arena.double(), *args[1:])
    h = x[:5].double() @ a.double().T
    assert float(h.abs().max()) > 65504  # the intermediate really leaves fp16's range
    if dtype == torch.float16:  # so a 16-bit intermediate (peft without autocast) overflows
        assert not bool(torch.isfinite(x[:5] @ a.T).all())
    assert float(ref.abs().max()) < 1e4  # ... and the result fits comfortably
    for split_k in (1, 3):
        y = y0.clone()
        add_lora_triton(y, x, *args, split_k=split_k)  # type: ignore[arg-type]
        assert rel_err(y, ref) < TOLERANCE[dtype], f"split_k={split_k}"


@pytest.mark.parametrize("dtype", DTYPES)
def test_attention_with_huge_scores(dtype: torch.dtype) -> None:
    """q.k reaches ~1e6 (far past fp16) on massive channels; softmax must stay finite."""
    case = build_case([(40, 40), (70, 1), (33, 5)], 4, 2, 64, 16, dtype, seed=5)
    gen = generator(6)
    q = case.q.view(-1, 64)
    _massive(q, 1e3, gen)
    kv = case.k_cache.reshape(-1, 64)
    rows = torch.isfinite(kv).all(-1)
    kv[rows] = _massive(kv[rows].clone(), 1e3, gen)
    args = (case.block_tables, case.seq_lens, case.query_starts, 64 ** -0.5)
    ref = paged_attention_reference(case.q.double(), case.k_cache.double(),
                                    case.v_cache.double(), *args)
    for max_query_len in (None, 40):
        out = paged_attention_triton(case.q, case.k_cache, case.v_cache, *args,
                                     max_query_len=max_query_len)
        assert rel_err(out, ref) < TOLERANCE[dtype]
    decode = build_case([(70, 1), (33, 1)], 4, 2, 64, 16, dtype, seed=7)
    _massive(decode.q.view(-1, 64), 1e3, gen)
    args = (decode.block_tables, decode.seq_lens, decode.query_starts, 64 ** -0.5)
    ref = paged_attention_reference(decode.q.double(), decode.k_cache.double(),
                                    decode.v_cache.double(), *args)
    out = paged_attention_triton(decode.q, decode.k_cache, decode.v_cache, *args,
                                 max_query_len=1)
    assert rel_err(out, ref) < TOLERANCE[dtype]
