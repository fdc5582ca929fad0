"""add_lora_fused (shrink and expand in one launch) against the float64 reference, on a
NaN-poisoned arena: one adapter over many rows, several segments, interleaved rows (the sorted
row list), base rows, mixed ranks (0, below and above the rank tile), several modules with
output slices, padded (CUDA-graph) tile lists, decode and prefill tile heights."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from kernels.lora_fused import FUSED_DECODE_TILES, FusedTiles, add_lora_fused
from kernels.lora_meta import DECODE_BLOCK_M, PREFILL_BLOCK_M, LoraMeta
from kernels.lora_reference import add_lora_reference
from tests.kernels.helpers import (
    DEVICE,
    DTYPES,
    ON_GPU,
    TOLERANCE,
    build_lora_case,
    generator,
    randn,
    rel_err,
)

QKV, O_PROJ, GATE_UP = (0, 1, 2), (3,), (4, 5)
# Small tiles so the CPU cases cross several K steps, column tiles and rank tiles.
SMALL = FusedTiles(block_m=DECODE_BLOCK_M, block_n=16, block_k=32)
SMALL_TALL = FusedTiles(block_m=PREFILL_BLOCK_M, block_n=32, block_k=16)


def padded(meta: LoraMeta, capacity: int) -> LoraMeta:
    """The tile list padded with unused (-1) entries to `capacity`, as graphs capture it."""
    pad = torch.full((capacity - meta.num_tiles,), -1, dtype=torch.int32, device=DEVICE)
    return dataclasses.replace(
        meta, tile_segs=torch.cat([meta.tile_segs, pad]),
        tile_m0=torch.cat([meta.tile_m0, torch.zeros_like(pad)]), num_tiles=capacity)


def _run(
    token_slots: list[int],
    num_slots: int,
    in_features: int,
    module_ids: tuple[int, ...],
    out_sizes: tuple[int, ...],
    rank_choices: list[int],
    dtype: torch.dtype,
    seed: int,
    *,
    tiles: FusedTiles | None = None,
    max_rank: int | None = None,
    aligned: bool = False,
    y_dtype: torch.dtype | None = None,
    capacity: int | None = None,
) -> None:
    """add_lora_fused on a random case against the float64 reference: untargeted rows and
    slices bit-for-bit untouched, the delta and y within the kernel tests' tolerance."""
    gen = generator(seed)
    sizes = dict(zip(module_ids, out_sizes, strict=True))
    rank_of = {
        (s, m): rank_choices[int(torch.randint(len(rank_choices), (1,), generator=gen))]
        for s in range(num_slots) for m in module_ids
    }
    block_m = tiles.block_m if tiles is not None else None
    case = build_lora_case(token_slots, num_slots, in_features, sizes, rank_of, dtype, gen,
                           aligned, block_m=block_m)
    meta = case.meta if capacity is None else padded(case.meta, capacity)
    starts = [sum(out_sizes[:i]) for i in range(len(out_sizes))]
    slices = tuple(zip(starts, out_sizes, strict=True))
    t = len(token_slots)
    x = randn(t, in_features, dtype=dtype, gen=gen)
    y0 = randn(t, sum(out_sizes), dtype=y_dtype or dtype, gen=gen)
    y = y0.clone()
    tables = (case.arena, case.a_offsets, case.b_offsets, case.ranks, case.scales)
    add_lora_fused(y, x, *tables, module_ids, slices, meta, max_rank=max_rank, tiles=tiles)
    y_ref = y0.double()
    add_lora_reference(y_ref, x.double(), case.arena.double(), *tables[1:], module_ids, slices,
                       case.meta)

    untouched = y_ref == y0.double()
    assert torch.equal(y[untouched], y0[untouched]), "wrote rows or slices nothing targets"
    delta, delta_ref = y.double() - y0.double(), y_ref - y0.double()
    if delta_ref.abs().sum() > 0:
        err = rel_err(delta, delta_ref)
        assert err < TOLERANCE[dtype] * 4, f"delta error {err:.2e}"
        assert rel_err(y, y_ref) < TOLERANCE[dtype], f"y error {rel_err(y, y_ref):.2e}"


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("tiles", [SMALL, None], ids=["small", "default"])
def test_one_adapter_over_many_rows(dtype: torch.dtype, tiles: FusedTiles | None) -> None:
    """U = 1 over 40 rows: three 16-row tiles of one segment, K not a multiple of the K step,
    output columns not a multiple of the column tile."""
    _run([0] * 40, 1, 80, O_PROJ, (40,), [16], dtype, seed=1, tiles=tiles, aligned=True,
         max_rank=16)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("aligned", [False, True])
def test_segments_mixed_ranks_qkv(dtype: torch.dtype, aligned: bool) -> None:
    """Grouped segments with base rows between them; ranks 0, below the 16-wide tile, the 32
    and 64 buckets and above the 64-wide tile (two rank tiles) under a rank-128 bound; q, k, v
    slices of unequal widths."""
    slots = [0] * 5 + [1] * 20 + [-1] * 3 + [2] * 7 + [3] + [-1]
    _run(slots, 5, 48, QKV, (48, 16, 16), [0, 1, 8, 16, 33, 64, 100], dtype, seed=2,
         tiles=SMALL, max_rank=128, aligned=aligned)


@pytest.mark.parametrize("dtype", DTYPES)
def test_interleaved_rows_through_the_sorted_row_list(dtype: torch.dtype) -> None:
    gen = generator(3)
    slots = [int(v) for v in torch.randint(-1, 3, (27,), generator=gen)]
    assert LoraMeta.from_token_slots(slots).token_rows is not None
    _run(slots, 3, 64, QKV, (32, 16, 16), [4, 8, 16], dtype, seed=4, tiles=SMALL, max_rank=16,
         aligned=True)


@pytest.mark.parametrize("dtype", DTYPES)
def test_rank_buckets_off_and_more_modules_than_one_launch(dtype: torch.dtype) -> None:
    """Four modules run as two launches; rank 0 marks modules an adapter does not target."""
    slots = [2, 2, 0, -1, 1, 1, 1, 3, -1]
    _run(slots, 4, 32, (0, 1, 2, 3), (32, 16, 16, 48), [0, 0, 8, 16, 40], dtype, seed=5,
         tiles=dataclasses.replace(SMALL, rank_buckets=False), max_rank=64)


@pytest.mark.parametrize("dtype", DTYPES)
def test_padded_tile_list_and_max_rank_read_from_the_tables(dtype: torch.dtype) -> None:
    """A tile list padded to twice its length (as graphs capture it); max_rank left to the
    launcher (ranks.max())."""
    slots = sorted(i % 3 for i in range(20))
    slots[-1] = -1
    _run(slots, 3, 64, GATE_UP, (40, 40), [8, 24], dtype, seed=6, tiles=SMALL, capacity=8)


def test_prefill_tile_height() -> None:
    slots = [0] + [1] * 130 + [-1] * 5 + [2] * 70
    _run(slots, 3, 32, O_PROJ, (48,), [2, 16, 64], torch.float16, seed=7, tiles=SMALL_TALL,
         max_rank=64)


@pytest.mark.parametrize("dtype", [d for d in DTYPES if d != torch.float32])
def test_float32_output_over_a_16_bit_arena(dtype: torch.dtype) -> None:
    _run([0, 0, 1, -1, 1], 2, 32, QKV, (32, 16, 16), [4, 8], dtype, seed=8, tiles=SMALL,
         y_dtype=torch.float32, max_rank=8)


def test_base_rows_only_and_padding_only_leave_y_untouched() -> None:
    _run([-1, -1, -1], 2, 32, O_PROJ, (32,), [8], torch.float32, seed=9, tiles=SMALL,
         max_rank=8)
    _run([-1, -1], 1, 32, QKV, (32, 16, 16), [8], torch.float32, seed=10, tiles=SMALL,
         max_rank=8, capacity=4)


def test_bad_inputs_are_refused() -> None:
    gen = generator(11)
    case = build_lora_case([0], 1, 16, {0: 16}, {(0, 0): 4}, torch.float32, gen)
    x = randn(1, 16, dtype=torch.float32, gen=gen)
    y = randn(1, 16, dtype=torch.float32, gen=gen)
    args = (case.arena, case.a_offsets, case.b_offsets, case.ranks, case.scales)
    with pytest.raises(ValueError, match="output slices"):
        add_lora_fused(y, x, *args, (0,), (), case.meta)
    with pytest.raises(ValueError, match="outside"):
        add_lora_fused(y, x, *args, (0,), ((8, 16),), case.meta)
    with pytest.raises(ValueError, match="1-D"):
        add_lora_fused(y, x, case.arena.half(), *args[1:], (0,), ((0, 16),), case.meta)
    with pytest.raises(ValueError, match="token count"):
        add_lora_fused(y[:0], x, *args, (0,), ((0, 16),), case.meta)
    with pytest.raises(ValueError, match="rows"):
        add_lora_fused(y, x, *args, (0,), ((0, 16),), case.meta,
                       tiles=dataclasses.replace(FUSED_DECODE_TILES, block_m=PREFILL_BLOCK_M))


@pytest.mark.skipif(not ON_GPU, reason="full-size shapes need the GPU (TRITON_INTERPRET=0)")
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("adapters", [1, 16])
def test_full_size_decode_on_gpu(dtype: torch.dtype, adapters: int) -> None:
    """Llama-3-8B q/k/v (hidden 4096, k/v 1024 wide) for 64 decode rows, ranks up to 128."""
    gen = generator(12)
    slots = [int(v) for v in torch.randint(adapters, (64,), generator=gen)]
    _run(slots, adapters, 4096, QKV, (4096, 1024, 1024), [0, 8, 16, 64, 128], dtype, seed=13,
         max_rank=128, aligned=dtype == torch.float16)
