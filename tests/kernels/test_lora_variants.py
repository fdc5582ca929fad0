"""The decode LoRA variants against the float64 reference: a K split chosen on the device from
the real length of a padded (CUDA-graph) tile list, rank-bucketed tiles, the rank budget on the
split. Every variant runs on a NaN-poisoned arena, so a read outside a matrix fails the test."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from kernels.lora import DECODE_TILES, add_lora_triton
from kernels.lora_meta import DECODE_BLOCK_M, LoraMeta
from kernels.lora_reference import add_lora_reference
from kernels.lora_shrink import lora_shrink
from tests.kernels.helpers import (
    DEVICE,
    DTYPES,
    TOLERANCE,
    build_lora_case,
    generator,
    randn,
    rel_err,
)

QKV = (0, 1, 2)
OUT_SIZES = {0: 48, 1: 32, 2: 32}
VARIANTS = {
    "device_split": DECODE_TILES,
    "no_rank_buckets": dataclasses.replace(DECODE_TILES, rank_buckets=False),
    "rank_budget": dataclasses.replace(DECODE_TILES, split_rank_budget=64),
}


def padded(meta: LoraMeta, capacity: int) -> LoraMeta:
    """The tile list padded with unused (-1) entries to `capacity`, as graphs capture it."""
    pad = torch.full((capacity - meta.num_tiles,), -1, dtype=torch.int32, device=DEVICE)
    return dataclasses.replace(
        meta, tile_segs=torch.cat([meta.tile_segs, pad]),
        tile_m0=torch.cat([meta.tile_m0, torch.zeros_like(pad)]), num_tiles=capacity,
        padded_tiles=True)


def _check(slots: list[int], adapters: int, ranks: list[int], dtype: torch.dtype, seed: int,
           capacity: int, tiles: object, max_rank: int = 64, in_features: int = 64) -> None:
    gen = generator(seed)
    rank_of = {(s, m): ranks[(s + m) % len(ranks)] for s in range(adapters) for m in QKV}
    case = build_lora_case(slots, adapters, in_features, OUT_SIZES, rank_of, dtype, gen,
                           aligned=seed % 2 == 0, block_m=DECODE_BLOCK_M)
    meta = padded(case.meta, capacity)
    slices = ((0, 48), (48, 32), (80, 32))
    x = randn(len(slots), in_features, dtype=dtype, gen=gen)
    y0 = randn(len(slots), 112, dtype=dtype, gen=gen)
    y = y0.clone()
    args = (case.arena, case.a_offsets, case.b_offsets, case.ranks, case.scales, QKV, slices)
    add_lora_triton(y, x, *args, meta, max_rank=max_rank, tiles=tiles)  # type: ignore[arg-type]
    y_ref = y0.double()
    add_lora_reference(y_ref, x.double(), case.arena.double(), *args[1:], case.meta)
    untouched = y_ref == y0.double()
    assert torch.equal(y[untouched], y0[untouched]), "wrote rows or slices nothing targets"
    err = rel_err(y - y0, (y_ref - y0.double()))
    assert err < TOLERANCE[dtype] * 4, f"delta error {err:.2e}"


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("variant", list(VARIANTS))
@pytest.mark.parametrize(("rows", "adapters", "k"), [(16, 1, 512), (12, 12, 64)])
def test_padded_tile_list_device_split(dtype: torch.dtype, variant: str, rows: int,
                                       adapters: int, k: int) -> None:
    """One adapter on a tile of rows (few real tiles: K split on the device) and one adapter a
    row (split 1), in a list padded to twice its length."""
    slots = sorted(i % adapters for i in range(rows))
    slots[-1] = -1  # a base-model row inside the last adapter's tile
    _check(slots, adapters, [8, 16, 64], dtype, seed=rows + adapters, capacity=2 * rows,
           tiles=VARIANTS[variant], in_features=k)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("ranks", [[8], [16, 24], [1, 8, 16, 32, 33, 64]])
def test_rank_buckets_mixed_ranks_under_a_wide_bound(dtype: torch.dtype,
                                                     ranks: list[int]) -> None:
    """Ranks meet the 16-, 32- and 64-wide tiles of a launch bounded at rank 64."""
    _check([2, 0, 0, 1, -1, 3, 3, 3, 1], 4, ranks, dtype, seed=len(ranks), capacity=12,
           tiles=DECODE_TILES)


def test_rank_buckets_under_a_rank_128_bound() -> None:
    _check([0, 1, 1, 2], 3, [8, 24, 100], torch.float16, seed=5, capacity=4,
           tiles=DECODE_TILES, max_rank=128)


@pytest.mark.parametrize(("real_rows", "capacity", "expect_split"),
                         [(16, 16, 4), (16, 200, 4), (64, 64, 1)])
def test_device_split_counts_only_real_tiles(real_rows: int, capacity: int,
                                             expect_split: int) -> None:
    """The shrink writes exactly the K splits it chose from the real tiles (poisoned buffer):
    target 24 over 1 real tile of 1 module -> 24, capped at 4 (also with 199 padding entries,
    past the count loop's first block); target 3 over 4 real tiles -> 1."""
    gen = generator(6)
    k = 1024  # K allows splits up to 4 (256 columns each)
    case = build_lora_case([0] * real_rows, 1, k, {0: 16}, {(0, 0): 16}, torch.float32, gen,
                           block_m=DECODE_BLOCK_M)
    meta = padded(case.meta, capacity)
    x = randn(real_rows, k, dtype=torch.float32, gen=gen)
    cap = 4
    buf = torch.full((cap, real_rows, 1, 16), float("nan"), device=DEVICE)
    target = 24 if real_rows == 16 else 3
    lora_shrink(buf, x, case.arena, case.a_offsets, case.ranks, (0,), meta, block_m=16,
                block_r=16, block_k=128, device_split_target=target)
    written = [bool(torch.isfinite(buf[j]).all()) for j in range(cap)]
    assert written == [j < expect_split for j in range(cap)]
    a = case.arena[int(case.a_offsets[0, 0]) :][: 16 * k].view(16, k).double()
    assert rel_err(buf[:expect_split].sum(0)[:, 0], x.double() @ a.T) < 1e-5


def test_all_padding_writes_nothing() -> None:
    gen = generator(4)
    case = build_lora_case([-1, -1], 1, 32, OUT_SIZES, {(0, m): 8 for m in QKV},
                           torch.float32, gen, block_m=DECODE_BLOCK_M)
    meta = padded(case.meta, 8)
    y = randn(2, 112, dtype=torch.float32, gen=gen)
    y0 = y.clone()
    add_lora_triton(y, randn(2, 32, dtype=torch.float32, gen=gen), case.arena, case.a_offsets,
                    case.b_offsets, case.ranks, case.scales, QKV,
                    ((0, 48), (48, 32), (80, 32)), meta, max_rank=8)
    assert torch.equal(y, y0)
