"""The sole-adapter merge's kernel (`slora_kernels.weight_merge`): ADD rounds w + scale * B @ A once
(checked against float64), the CHECK collects exactly the elements a SUBTRACT after the ADD
does not give back (positions and original values, counted past a full buffer), and the
SUBTRACT plus those kept values restores w bit for bit."""

from __future__ import annotations

import pytest
import torch

from slora_kernels.jit_stats import compiled_kernel_variants
from slora_kernels.weight_merge import ADD, SUBTRACT, check_round_trip, merge_delta, warm_up
from tests.kernel_tests.helpers import ON_GPU, generator, randn

# 16-bit weights only; the interpreter computes bf16 wrongly, so bf16 runs on the GPU only.
DTYPES = [torch.float16, torch.bfloat16] if ON_GPU else [torch.float16]


def _case(rows: int, k: int, rank: int, dtype: torch.dtype, std: float, seed: int = 0
          ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    gen = generator(seed)
    w = randn(rows, k, dtype=dtype, gen=gen, std=0.05).contiguous()
    a = randn(rank, k, dtype=dtype, gen=gen, std=std).contiguous()
    b = randn(rows, rank, dtype=dtype, gen=gen, std=std).contiguous()
    return w, a, b


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.int16)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("rows", "k", "rank"), [(70, 200, 8), (130, 96, 20), (64, 128, 64)])
def test_merge_check_and_restore_round_trip_exactly(dtype, rows, k, rank):
    # Deltas about a tenth of the weights: a few percent of the round trips are inexact.
    w, a, b = _case(rows, k, rank, dtype, std=(0.005 / rank**0.5) ** 0.5)
    scale = 1.5
    w0 = w.clone()
    positions, values, count = check_round_trip(w, a, b, scale, capacity=w.numel())
    assert torch.equal(_bits(w), _bits(w0))  # the CHECK writes only its buffers
    n = int(count)
    positions, values = positions[:n].long(), values[:n]
    assert torch.equal(_bits(values), _bits(w0.view(-1)[positions]))
    merge_delta(w, a, b, scale, ADD)
    # One rounding of the float32 sum: the float64 sum correctly rounded, except where the
    # float32 sum's own error (~2^-24 relative) crosses a rounding boundary: rare, and then
    # the neighbouring value.
    ref = (w0.double() + scale * (b.double() @ a.double())).to(dtype)
    off = (_bits(w).int() - _bits(ref).int()).abs()
    assert int((off != 0).sum()) <= max(1, w.numel() // 1000)
    assert int(off.max()) <= 1
    merge_delta(w, a, b, scale, SUBTRACT)
    wrong = (_bits(w) != _bits(w0)).view(-1).nonzero().view(-1)
    # The CHECK found exactly the elements that come back wrong, each once, and there are some.
    assert torch.equal(positions.sort().values, wrong)
    assert 0 < n < w.numel() // 4
    w.view(-1)[positions] = values
    assert torch.equal(_bits(w), _bits(w0))


def test_a_full_buffer_counts_on_and_writes_nothing_past_it():
    w, a, b = _case(70, 200, 8, torch.float16, std=(0.005 / 8**0.5) ** 0.5)
    _, _, count = check_round_trip(w, a, b, 1.5, capacity=w.numel())
    full = int(count)
    cap = full // 3
    positions, values, count = check_round_trip(w, a, b, 1.5, capacity=cap)
    assert int(count) == full > cap and positions.numel() == cap
    # What was stored is a part of the full set, each a real exception with its value.
    assert bool((positions >= 0).all()) and bool((positions < w.numel()).all())
    assert positions.unique().numel() == cap
    assert torch.equal(_bits(values), _bits(w.view(-1)[positions.long()]))


def test_small_deltas_round_trip_with_few_exceptions():
    w, a, b = _case(96, 160, 16, torch.float16, std=(1e-5 / 16**0.5) ** 0.5, seed=3)
    _, _, count = check_round_trip(w, a, b, 1.0, capacity=w.numel())
    assert int(count) < w.numel() // 50


@pytest.mark.skipif(not ON_GPU, reason="the interpreter compiles nothing")
@pytest.mark.parametrize("dtype", DTYPES)
def test_after_warm_up_no_merge_compiles(dtype):
    """Sizes are not specialized on: warm-up on 16x16 inputs compiles what any rank up to
    the bound runs, so a first merge mid-serving compiles nothing."""
    warm_up(dtype, 64, torch.device("cuda"))
    before = compiled_kernel_variants()
    for rows, k, rank in [(4096, 4096, 16), (11008, 4096, 8), (1000, 4104, 40), (512, 11008, 64)]:
        w, a, b = _case(rows, k, rank, dtype, std=0.01)
        check_round_trip(w, a, b, 2.0, capacity=1000)
        merge_delta(w, a, b, 2.0, ADD)
        merge_delta(w, a, b, 2.0, SUBTRACT)
    torch.cuda.synchronize()
    assert compiled_kernel_variants() == before


def test_bad_inputs_are_refused():
    w, a, b = _case(32, 64, 8, torch.float16, std=0.1)
    with pytest.raises(ValueError, match="16-bit"):
        merge_delta(w.float(), a.float(), b.float(), 1.0, ADD)
    with pytest.raises(ValueError, match="do not factor"):
        merge_delta(w, a[:, :32].contiguous(), b, 1.0, ADD)
    with pytest.raises(ValueError, match="do not factor"):
        merge_delta(w, a, b.float(), 1.0, ADD)
    with pytest.raises(ValueError, match="mode"):
        merge_delta(w, a, b, 1.0, 7)
    with pytest.raises(ValueError, match="contiguous 2-D"):
        merge_delta(w.t(), a, b, 1.0, ADD)
    with pytest.raises(ValueError, match="16-bit"):
        check_round_trip(w.float(), a.float(), b.float(), 1.0, capacity=8)
    with pytest.raises(ValueError, match="capacity"):
        check_round_trip(w, a, b, 1.0, capacity=-1)
