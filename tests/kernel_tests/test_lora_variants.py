"""The decode LoRA variants against the float64 reference on padded (CUDA-graph) tile lists:
rank-bucketed tiles on and off, the rank budget on the K split, K splits from 1 up. Every
variant runs on a NaN-poisoned arena, so a read outside a matrix fails the test."""

from __future__ import annotations

import dataclasses

import pytest
import torch

import slora_kernels.lora
from slora_kernels.lora import (
    DECODE_TILES,
    PREFILL_TILES,
    add_lora_triton,
    pick_split,
    split_cap,
)
from slora_kernels.lora_expand import lora_expand
from slora_kernels.lora_meta import DECODE_BLOCK_M, PREFILL_BLOCK_M, LoraMeta
from slora_kernels.lora_reference import add_lora_reference
from slora_kernels.lora_shrink import lora_shrink
from tests.kernel_tests.helpers import (
    DEVICE,
    DTYPES,
    TOLERANCE,
    LoraCase,
    build_lora_case,
    generator,
    randn,
    rel_err,
)

QKV = (0, 1, 2)
OUT_SIZES = {0: 48, 1: 32, 2: 32}
VARIANTS = {
    "default": DECODE_TILES,
    "no_rank_buckets": dataclasses.replace(DECODE_TILES, rank_buckets=False),
    "early_loads": dataclasses.replace(DECODE_TILES, early_loads=True),
    "no_pdl": dataclasses.replace(DECODE_TILES, pdl=False),
    "no_pdl_early_loads": dataclasses.replace(DECODE_TILES, pdl=False, early_loads=True),
    "no_wave_split": dataclasses.replace(DECODE_TILES, wave_split=False),
    # Column tiles a program (LoraTiles.expand_cols) on 16-column tiles, so that the 48 and
    # 32 outputs take several: groups of two (the last with one tile past the outputs) and
    # of four (one group a module, partly past them).
    "cols2": dataclasses.replace(DECODE_TILES, expand_block_n=16, expand_cols=2),
    "cols4_no_pdl": dataclasses.replace(DECODE_TILES, expand_block_n=16, expand_cols=4,
                                        pdl=False),
}


def padded(meta: LoraMeta, capacity: int) -> LoraMeta:
    """The tile list padded with unused (-1) entries to `capacity`, as graphs capture it."""
    pad = torch.full((capacity - meta.num_tiles,), -1, dtype=torch.int32, device=DEVICE)
    return dataclasses.replace(
        meta, tile_segs=torch.cat([meta.tile_segs, pad]),
        tile_m0=torch.cat([meta.tile_m0, torch.zeros_like(pad)]), num_tiles=capacity)


def _check(slots: list[int], adapters: int, ranks: list[int], dtype: torch.dtype, seed: int,
           capacity: int, tiles: object, max_rank: int = 64, in_features: int = 64,
           split_k: int | None = None, block_m: int = DECODE_BLOCK_M) -> None:
    gen = generator(seed)
    rank_of = {(s, m): ranks[(s + m) % len(ranks)] for s in range(adapters) for m in QKV}
    case = build_lora_case(slots, adapters, in_features, OUT_SIZES, rank_of, dtype, gen,
                           aligned=seed % 2 == 0, block_m=block_m)
    meta = padded(case.meta, capacity)
    slices = ((0, 48), (48, 32), (80, 32))
    x = randn(len(slots), in_features, dtype=dtype, gen=gen)
    y0 = randn(len(slots), 112, dtype=dtype, gen=gen)
    y = y0.clone()
    args = (case.arena, case.a_offsets, case.b_offsets, case.ranks, case.scales, QKV, slices)
    add_lora_triton(y, x, *args, meta, max_rank=max_rank, tiles=tiles,  # type: ignore[arg-type]
                    split_k=split_k)
    y_ref = y0.double()
    add_lora_reference(y_ref, x.double(), case.arena.double(), *args[1:], case.meta)
    untouched = y_ref == y0.double()
    assert torch.equal(y[untouched], y0[untouched]), "wrote rows or slices nothing targets"
    err = rel_err(y - y0, (y_ref - y0.double()))
    assert err < TOLERANCE[dtype] * 4, f"delta error {err:.2e}"


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("variant", list(VARIANTS))
@pytest.mark.parametrize(("rows", "adapters", "k", "split_k"),
                         [(16, 1, 512, 2), (12, 12, 64, None)])
def test_padded_tile_list(dtype: torch.dtype, variant: str, rows: int, adapters: int, k: int,
                          split_k: int | None) -> None:
    """One adapter on a tile of rows with K split in two, and one adapter a row, in a list
    padded to twice its length (as graphs capture it)."""
    slots = sorted(i % adapters for i in range(rows))
    slots[-1] = -1  # a base-model row inside the last adapter's tile
    _check(slots, adapters, [8, 16, 64], dtype, seed=rows + adapters, capacity=2 * rows,
           tiles=VARIANTS[variant], in_features=k, split_k=split_k)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("ranks", [[8], [16, 24], [1, 8, 16, 32, 33, 64]])
@pytest.mark.parametrize("variant", ["default", "cols2", "cols4_no_pdl"])
def test_rank_buckets_mixed_ranks_under_a_wide_bound(dtype: torch.dtype,
                                                     ranks: list[int], variant: str) -> None:
    """Ranks meet the 16-, 32- and 64-wide tiles of a launch bounded at rank 64."""
    _check([2, 0, 0, 1, -1, 3, 3, 3, 1], 4, ranks, dtype, seed=len(ranks), capacity=12,
           tiles=VARIANTS[variant])


@pytest.mark.parametrize("variant", ["default", "cols2"])
def test_rank_buckets_under_a_rank_128_bound(variant: str) -> None:
    """Rank 100 under a 128 bound loops over 64-wide rank tiles (with column tiles a
    program, a column tile at a time)."""
    _check([0, 1, 1, 2], 3, [8, 24, 100], torch.float16, seed=5, capacity=4,
           tiles=VARIANTS[variant], max_rank=128)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("block_n", "cols"), [(16, 2), (16, 4), (32, 8)])
def test_64_row_tiles_with_column_tiles_a_program(dtype: torch.dtype, block_n: int,
                                                  cols: int) -> None:
    """Prompt chunks' 64-row tiles (PREFILL_TILES) with expand programs covering several
    column tiles (PREFILL_TILES takes four): a 70-row segment over two tiles, a base row, a
    5-row one, with K split in two, in a list padded as graphs capture it."""
    tiles = dataclasses.replace(PREFILL_TILES, expand_block_n=block_n, expand_cols=cols)
    slots = [0] * 70 + [-1] + [1] * 5
    _check(slots, 2, [8, 64], dtype, seed=cols, capacity=6, tiles=tiles, in_features=128,
           split_k=2, block_m=PREFILL_BLOCK_M)


def test_expand_refuses_fewer_than_one_column_tile_a_program() -> None:
    gen = generator(7)
    case = build_lora_case([0, 0], 1, 32, OUT_SIZES, {(0, m): 8 for m in QKV},
                           torch.float32, gen, block_m=DECODE_BLOCK_M)
    y = randn(2, 112, dtype=torch.float32, gen=gen)
    y0 = y.clone()
    buf = torch.zeros((1, 2, 3, 8), device=DEVICE)
    with pytest.raises(ValueError, match="cols must be at least 1, got 0"):
        lora_expand(y, buf, case.arena, case.b_offsets, case.ranks, case.scales, QKV,
                    ((0, 48), (48, 32), (80, 32)), case.meta, block_m=DECODE_BLOCK_M,
                    block_n=16, block_r=16, cols=0)
    assert torch.equal(y, y0)


def test_shrink_work_items_cover_every_split() -> None:
    """The shrink's programs walk (tile, module, split) items: with 3 splits over 2 tiles and
    2 modules (and 4 padding entries), every split slice of every row is written (poisoned
    buffer) and the slices add up to x @ A.T."""
    gen = generator(6)
    k, split = 768, 3
    slots = [0] * 20 + [1] * 3
    rank_of = {(s, m): 16 for s in range(2) for m in (0, 1)}
    case = build_lora_case(slots, 2, k, {0: 16, 1: 16}, rank_of, torch.float32, gen,
                           block_m=DECODE_BLOCK_M)
    meta = padded(case.meta, 6)
    x = randn(len(slots), k, dtype=torch.float32, gen=gen)
    buf = torch.full((split, len(slots), 2, 16), float("nan"), device=DEVICE)
    lora_shrink(buf, x, case.arena, case.a_offsets, case.ranks, (0, 1), meta, block_m=16,
                block_r=16, block_k=128)
    assert bool(torch.isfinite(buf).all())
    for t, slot in enumerate(slots):
        for i in (0, 1):
            off = int(case.a_offsets[slot, i])
            a = case.arena[off : off + 16 * k].view(16, k).double()
            assert rel_err(buf[:, t, i].sum(0), x[t].double() @ a.T) < 1e-5


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


def test_split_rank_budget_caps_the_split() -> None:
    budget = dataclasses.replace(DECODE_TILES, split_rank_budget=256)
    assert split_cap(DECODE_TILES, 4096, 64) == 16  # tiles' cap
    assert split_cap(budget, 4096, 64) == 4  # 256 // 64
    assert split_cap(budget, 4096, 16) == 16
    assert split_cap(budget, 512, 16) == 2  # K / 256


def test_wave_split_keeps_short_launches_to_one_wave(monkeypatch: pytest.MonkeyPatch) -> None:
    """With `wave_split` (the default), launches of at most 16 tiles at rank tile 64 take the
    largest power of two that keeps tiles x splits within one program a multiprocessor (132 on
    the H200), whatever the module count; longer launches, narrower rank tiles, and tiles
    without the option keep four programs a multiprocessor."""
    monkeypatch.setattr(slora_kernels.lora, "_num_sms", lambda device: 132)
    wave = dataclasses.replace(DECODE_TILES, wave_split=True)
    old = dataclasses.replace(DECODE_TILES, wave_split=False)
    assert DECODE_TILES.wave_split  # the default
    cpu = torch.device("cpu")
    got = {(n, m): pick_split(wave, n, m, 4096, cpu, 64) for n in (1, 4, 8, 16) for m in (1, 3)}
    assert got == {(1, 1): 16, (1, 3): 16, (4, 1): 16, (4, 3): 16, (8, 1): 16, (8, 3): 16,
                   (16, 1): 8, (16, 3): 8}
    assert pick_split(wave, 12, 1, 4096, cpu, 64) == 8  # cdiv(132, 12) = 11 -> 8
    assert pick_split(wave, 16, 1, 1024, cpu, 64) == 4  # K / 256 caps it
    budget = dataclasses.replace(wave, split_rank_budget=256)
    assert pick_split(budget, 16, 1, 4096, cpu, 64) == 4  # and the rank budget
    # Past 16 tiles, below rank tile 64, and without the option: four programs a
    # multiprocessor (cdiv(528, tiles x modules), capped at 16).
    assert pick_split(wave, 64, 1, 4096, cpu, 64) == pick_split(old, 64, 1, 4096, cpu, 64) == 9
    assert pick_split(wave, 16, 1, 4096, cpu, 32) == pick_split(wave, 16, 1, 4096, cpu, 16) == 16
    assert [pick_split(old, n, m, 4096, cpu, 64)
            for n, m in ((1, 1), (16, 1), (16, 2), (16, 3))] == [16, 16, 16, 11]


def _per_token_delta(case: LoraCase, x: torch.Tensor, slots: list[int], k: int,
                     slices: tuple[tuple[int, int], ...]) -> torch.Tensor:
    """The delta token by token in float64, from the tables alone (no segments)."""
    arena = case.arena.double()
    out = torch.zeros(len(slots), sum(n for _, n in slices), dtype=torch.float64,
                      device=x.device)
    for t, s in enumerate(slots):
        if s < 0:
            continue
        for m, (o_start, n) in zip(QKV, slices, strict=True):
            r = int(case.ranks[s, m])
            a_off, b_off = int(case.a_offsets[s, m]), int(case.b_offsets[s, m])
            a = arena[a_off : a_off + r * k].view(r, k)
            b = arena[b_off : b_off + n * r].view(n, r)
            out[t, o_start : o_start + n] = (x[t].double() @ a.T) @ b.T * float(case.scales[s, m])
    return out


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("split_k", [None, 3, 16])
def test_interleaved_adapters_are_sorted_into_one_segment_each(
        dtype: torch.dtype, split_k: int | None) -> None:
    """Tokens of 3 adapters in random order (and base tokens among them): one segment per
    adapter through the sorted row list, each adapter's rows in one tile, against a
    per-token float64 delta."""
    gen = generator(31 + (split_k or 0))
    slots = [int(v) for v in torch.randint(-1, 3, (24,), generator=gen)]
    meta = LoraMeta.from_token_slots(slots, device=DEVICE, block_m=DECODE_BLOCK_M)
    assert meta.token_rows is not None and meta.num_segments == len({s for s in slots if s >= 0})
    rows = meta.token_rows.tolist()
    assert sorted(rows) == list(range(len(slots)))
    assert [slots[r] for r in rows] == sorted(slots)  # stable sort by slot
    rank_of = {(s, m): (16, 8, 4)[(s + m) % 3] for s in range(3) for m in QKV}
    k = 512
    case = build_lora_case(slots, 3, k, OUT_SIZES, rank_of, dtype, gen, aligned=True,
                           block_m=DECODE_BLOCK_M)
    assert case.meta.token_rows is not None
    slices = ((0, 48), (48, 32), (80, 32))
    x = randn(len(slots), k, dtype=dtype, gen=gen)
    y0 = randn(len(slots), 112, dtype=dtype, gen=gen)
    y = y0.clone()
    add_lora_triton(y, x, case.arena, case.a_offsets, case.b_offsets, case.ranks, case.scales,
                    QKV, slices, case.meta, max_rank=16, tiles=DECODE_TILES, split_k=split_k)
    want = _per_token_delta(case, x, slots, k, slices)
    base = torch.tensor([s < 0 for s in slots], device=DEVICE)
    assert torch.equal(y[base], y0[base]), "base-model rows were written"
    err = rel_err(y - y0, want)
    assert err < TOLERANCE[dtype] * 4, f"delta error {err:.2e}"
    y_ref = y0.double()
    add_lora_reference(y_ref, x.double(), case.arena.double(), case.a_offsets, case.b_offsets,
                       case.ranks, case.scales, QKV, slices, case.meta)
    assert rel_err(y_ref - y0.double(), want) < 1e-12


def test_grouped_tokens_keep_runs_and_no_row_list() -> None:
    """Tokens already grouped by adapter (the scheduler's order) are read in place."""
    meta = LoraMeta.from_token_slots([2, 2, -1, 0, 0, 0, 5], block_m=DECODE_BLOCK_M)
    assert meta.token_rows is None
    assert meta.seg_starts.tolist() == [0, 3, 6] and meta.seg_slots.tolist() == [2, 0, 5]
    split = LoraMeta.from_token_slots([2, 0, 2, -1], block_m=DECODE_BLOCK_M)
    assert split.token_rows is not None and split.token_rows.tolist() == [3, 1, 0, 2]
    assert split.seg_starts.tolist() == [1, 2] and split.seg_lens.tolist() == [1, 2]
    assert split.seg_slots.tolist() == [0, 2]
