"""The fused decode LoRA kernel (kernels/lora_fused.py) against the float64 reference on a
NaN-poisoned arena, and against the two-launch path it would replace."""

from __future__ import annotations

import pytest
import torch

from kernels.lora import add_lora_triton
from kernels.lora_fused import add_lora_fused
from kernels.lora_reference import add_lora_reference
from tests.kernels.helpers import DTYPES, TOLERANCE, build_lora_case, generator, randn, rel_err

QKV, O_PROJ, GATE_UP = (0, 1, 2), (3,), (4, 5)


def _case(token_slots: list[int], num_slots: int, k: int, mods: tuple[int, ...],
          outs: tuple[int, ...], ranks: list[int], dtype: torch.dtype, seed: int,
          aligned: bool) -> tuple[torch.Tensor, torch.Tensor, tuple, tuple]:
    gen = generator(seed)
    rank_of = {(s, m): ranks[int(torch.randint(len(ranks), (1,), generator=gen))]
               for s in range(num_slots) for m in mods}
    case = build_lora_case(token_slots, num_slots, k, dict(zip(mods, outs, strict=True)),
                           rank_of, dtype, gen, aligned)
    starts = [sum(outs[:i]) for i in range(len(outs))]
    slices = tuple(zip(starts, outs, strict=True))
    x = randn(len(token_slots), k, dtype=dtype, gen=gen)
    y0 = randn(len(token_slots), sum(outs), dtype=dtype, gen=gen)
    args = (case.arena, case.a_offsets, case.b_offsets, case.ranks, case.scales, mods, slices,
            case.meta)
    return x, y0, args, (max(ranks),)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("aligned", [False, True])
@pytest.mark.parametrize(("mods", "outs", "ranks"), [
    (QKV, (48, 16, 16), [0, 4, 8, 24]),   # mixed ranks, some modules untargeted
    (O_PROJ, (40,), [16]),                 # one adapter rank, two output tiles
    (GATE_UP + O_PROJ + QKV, (24, 24, 40, 48, 16, 16), [8, 40]),  # two launches, rank > 32
])
def test_fused_matches_the_float64_reference(dtype: torch.dtype, aligned: bool,
                                             mods: tuple[int, ...], outs: tuple[int, ...],
                                             ranks: list[int]) -> None:
    slots = [2, 2, 2, -1, 0, 1, 1, 3, -1, 0, 0, 0, 0, 3, 2, 1, 1, 1, 1]
    x, y0, args, (max_rank,) = _case(slots, 4, 64, mods, outs, ranks, dtype, 7, aligned)
    y = y0.clone()
    add_lora_fused(y, x, *args, max_rank=max_rank, block_n=32, block_k=32)
    y_ref = y0.double()
    add_lora_reference(y_ref, x.double(), args[0].double(), *args[1:])
    untouched = y_ref == y0.double()  # rows of no adapter, modules of rank 0
    assert untouched.any() and torch.equal(y[untouched], y0[untouched])
    delta, delta_ref = y.double() - y0.double(), y_ref - y0.double()
    assert rel_err(delta, delta_ref) < TOLERANCE[dtype] * 4
    assert rel_err(y, y_ref) < TOLERANCE[dtype]


@pytest.mark.parametrize("dtype", DTYPES)
def test_fused_equals_the_two_launch_path_on_one_adapter(dtype: torch.dtype) -> None:
    """One adapter on every row (the case the fusion is for): the same float32 sums as shrink
    + expand without a K split, to rounding of the last add."""
    slots = [0] * 12
    x, y0, args, (max_rank,) = _case(slots, 1, 64, QKV, (32, 16, 16), [16], dtype, 3, True)
    fused, two = y0.clone(), y0.clone()
    add_lora_fused(fused, x, *args, max_rank=max_rank, block_n=32, block_k=32)
    add_lora_triton(two, x, *args, max_rank=max_rank, split_k=1)
    assert rel_err(fused, two) < TOLERANCE[dtype] / 4


def test_fused_refuses_bad_inputs() -> None:
    x, y0, args, _ = _case([0, 0], 1, 32, O_PROJ, (16,), [8], torch.float32, 1, True)
    with pytest.raises(ValueError, match="disagree on the token count"):
        add_lora_fused(y0[:1], x, *args, max_rank=8)
    with pytest.raises(ValueError, match="outside y's"):
        add_lora_fused(y0, x, *args[:6], ((8, 16),), args[7], max_rank=8)
    with pytest.raises(ValueError, match="arena must be 1-D"):  # neither x's dtype nor float32
        add_lora_fused(y0.bfloat16(), x.bfloat16(), args[0].half(), *args[1:], max_rank=8)
