"""add_lora_triton and the shrink kernel against the float64 reference, on a poisoned arena."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from slora_kernels.lora import DECODE_TILES, PREFILL_TILES, add_lora_triton
from slora_kernels.lora_meta import ROW_BLOCK_M
from slora_kernels.lora_reference import add_lora_reference
from slora_kernels.lora_rows import RowTiles
from slora_kernels.lora_shrink import lora_shrink
from tests.kernel_tests.helpers import (
    DEVICE,
    DTYPES,
    ON_GPU,
    TOLERANCE,
    build_lora_case,
    generator,
    randn,
    rel_err,
)

QKV, O_PROJ, GATE_UP, DOWN = (0, 1, 2), (3,), (4, 5), (6,)


def _run(
    token_slots: list[int],
    num_slots: int,
    in_features: int,
    module_ids: tuple[int, ...],
    out_sizes: tuple[int, ...],
    rank_choices: list[int],
    dtype: torch.dtype,
    seed: int,
    aligned: bool = False,
    block_m: int | None = None,
    **knobs: object,
) -> None:
    """Run add_lora_triton on a random case and compare y with the float64 reference. `block_m` (else the tiles') picks the meta's tile height;
    ROW_BLOCK_M runs the row kernels."""
    gen = generator(seed)
    sizes = dict(zip(module_ids, out_sizes, strict=True))
    rank_of = {
        (s, m): rank_choices[int(torch.randint(len(rank_choices), (1,), generator=gen))]
        for s in range(num_slots) for m in module_ids
    }
    tiles = knobs.get("tiles")
    case = build_lora_case(token_slots, num_slots, in_features, sizes, rank_of, dtype, gen,
                           aligned, block_m=block_m or getattr(tiles, "shrink_block_m", None))
    starts = [sum(out_sizes[:i]) for i in range(len(out_sizes))]
    slices = tuple(zip(starts, out_sizes, strict=True))
    t = len(token_slots)
    x = randn(t, in_features, dtype=dtype, gen=gen)
    y0 = randn(t, sum(out_sizes), dtype=dtype, gen=gen)
    y = y0.clone()
    args = (case.arena, case.a_offsets, case.b_offsets, case.ranks, case.scales, module_ids,
            slices, case.meta)
    add_lora_triton(y, x, *args, **knobs)  # type: ignore[arg-type]
    y_ref = y0.double()
    add_lora_reference(y_ref, x.double(), case.arena.double(), *args[1:])

    # Rows and slices nothing targets must be bit-for-bit untouched.
    untouched = y_ref == y0.double()
    assert torch.equal(y[untouched], y0[untouched])
    delta, delta_ref = y.double() - y0.double(), y_ref - y0.double()
    if delta_ref.abs().sum() > 0:
        err = rel_err(delta, delta_ref)
        assert err < TOLERANCE[dtype] * 4, f"delta error {err:.2e}"
        assert rel_err(y, y_ref) < TOLERANCE[dtype], f"y error {rel_err(y, y_ref):.2e}"


def _decode_slots(n: int, num_slots: int, seed: int, none_every: int = 5) -> list[int]:
    gen = generator(seed)
    slots = torch.randint(num_slots, (n,), generator=gen).tolist()
    return [-1 if i % none_every == none_every - 1 else s for i, s in enumerate(slots)]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("split_k", [None, 1, 3])
@pytest.mark.parametrize("aligned", [False, True])
def test_decode_mixed_ranks_qkv(dtype: torch.dtype, split_k: int | None, aligned: bool) -> None:
    slots = _decode_slots(12, 6, seed=1)
    _run(slots, 6, 64, QKV, (64, 32, 32), [1, 8, 16, 33, 64, 128], dtype, seed=2,
         aligned=aligned, split_k=split_k, max_rank=128)


def test_rank_balanced_row_split_keeps_one_rank_launches_as_wide() -> None:
    """A rank-balanced row launch aims for block_r // 16 times the splits under raised caps,
    so its rank-16 rows run as many splits as an unbalanced launch's (at least one); at rank
    tile 16 nothing changes."""
    from slora_kernels.lora import row_split_k

    dev = torch.device("cpu")  # 4 multiprocessors (lora._num_sms)
    on, off = RowTiles(rank_balanced=True), RowTiles(rank_balanced=False)
    for programs, k in ((1, 4096), (2, 4096), (64, 11008), (3, 512)):
        # active_splits: a rank-16 row uses a quarter of the splits, at least one.
        assert max(1, row_split_k(on, programs, k, dev, 64) // 4) == row_split_k(
            off, programs, k, dev, 64)
        assert row_split_k(on, programs, k, dev, 16) == row_split_k(off, programs, k, dev, 16)


@pytest.mark.parametrize("dtype", DTYPES)
def test_shared_adapter_decode_segments(dtype: torch.dtype) -> None:
    # Requests sharing an adapter sit next to each other: segments of several decode tokens.
    slots = [0, 0, 0, 2, 2, -1, 1, 1, 1, 1, 1, 3, -1, -1, 0]
    _run(slots, 4, 96, GATE_UP, (80, 80), [0, 4, 16, 24], dtype, seed=3)


@pytest.mark.parametrize("dtype", DTYPES)
def test_prefill_segments_hundreds_of_tokens(dtype: torch.dtype) -> None:
    slots = [0] * 1 + [1] * 130 + [-1] * 5 + [2] * 300 + [3] * 7
    _run(slots, 4, 48, DOWN, (64,), [2, 16, 64, 128], dtype, seed=4, aligned=True, split_k=2)


@pytest.mark.parametrize("dtype", DTYPES)
def test_untargeted_modules_and_many_modules_in_one_call(dtype: torch.dtype) -> None:
    # Four modules exceed one launch's three; rank 0 marks modules an adapter does not target.
    slots = _decode_slots(9, 5, seed=5, none_every=4)
    _run(slots, 5, 32, (0, 1, 2, 3), (32, 16, 16, 48), [0, 0, 8, 16], dtype, seed=6)


@pytest.mark.parametrize("tiles", [DECODE_TILES, PREFILL_TILES])
def test_tile_tables_on_mixed_batch(tiles: object) -> None:
    slots = [3] * 20 + _decode_slots(6, 4, seed=7) + [1] * 17
    _run(slots, 4, 40, QKV, (40, 24, 24), [1, 17, 32], torch.float16, seed=8, tiles=tiles)


def test_no_segments_and_all_base_tokens_leave_y_untouched() -> None:
    _run([-1, -1, -1], 2, 32, O_PROJ, (32,), [8], torch.float32, seed=9)


@pytest.mark.parametrize("dtype", DTYPES)
def test_shrink_writes_only_real_ranks_and_segment_tokens(dtype: torch.dtype) -> None:
    gen = generator(10)
    k, max_rank, split = 64, 32, 2
    slots = [0, 0, -1, 1, 2, 2, 2]
    rank_of = {(0, 0): 5, (1, 0): 32, (2, 0): 17, (0, 1): 0, (1, 1): 9, (2, 1): 1}
    case = build_lora_case(slots, 3, k, {0: 16, 1: 16}, rank_of, dtype, gen)
    x = randn(len(slots), k, dtype=dtype, gen=gen)
    buf = torch.full((split, len(slots), 2, max_rank), float("nan"), device=DEVICE)
    lora_shrink(buf, x, case.arena, case.a_offsets, case.ranks, (0, 1), case.meta,
                block_m=16, block_r=16, block_k=16)
    for t, slot in enumerate(slots):
        for i in range(2):
            r = rank_of[(slot, i)] if slot >= 0 else 0
            assert torch.isnan(buf[:, t, i, r:]).all(), "wrote past the rank or a base token"
            if r == 0:
                continue
            off = int(case.a_offsets[slot, i])
            a = case.arena[off : off + r * k].view(r, k).double()
            ref = x[t].double() @ a.T
            assert rel_err(buf[:, t, i, :r].sum(0), ref) < TOLERANCE[torch.float32] * 10


def test_bad_inputs_are_refused() -> None:
    gen = generator(11)
    case = build_lora_case([0], 1, 16, {0: 16}, {(0, 0): 4}, torch.float32, gen)
    x = randn(1, 16, dtype=torch.float32, gen=gen)
    y = randn(1, 16, dtype=torch.float32, gen=gen)
    args = (case.arena, case.a_offsets, case.b_offsets, case.ranks, case.scales)
    with pytest.raises(ValueError, match="output slices"):
        add_lora_triton(y, x, *args, (0,), (), case.meta)
    with pytest.raises(ValueError, match="outside"):
        add_lora_triton(y, x, *args, (0,), ((8, 16),), case.meta)
    with pytest.raises(ValueError, match="1-D"):
        add_lora_triton(y, x, case.arena.half(), *args[1:], (0,), ((0, 16),), case.meta)


# Full model shapes, run only on a GPU (TRITON_INTERPRET=0): Llama-2-7B (hidden 4096, MHA) and
# Llama-3-8B (GQA: k/v 1024 wide, MLP 14336).
FULL_SHAPES = [
    ("llama2-qkv", 4096, QKV, (4096, 4096, 4096)),
    ("llama3-qkv", 4096, QKV, (4096, 1024, 1024)),
    ("llama3-o", 4096, O_PROJ, (4096,)),
    ("llama3-gate_up", 4096, GATE_UP, (14336, 14336)),
    ("llama3-down", 14336, DOWN, (4096,)),
]


@pytest.mark.skipif(not ON_GPU, reason="full-size shapes need the GPU (TRITON_INTERPRET=0)")
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("name", "k", "mods", "outs"), FULL_SHAPES, ids=[s[0] for s in FULL_SHAPES])
@pytest.mark.parametrize("batch", ["decode", "prefill", "rows"])
def test_full_size_on_gpu(dtype: torch.dtype, name: str, k: int, mods: tuple[int, ...],
                          outs: tuple[int, ...], batch: str) -> None:
    if batch == "prefill":
        slots = [0] * 700 + [5] * 1 + [-1] * 30 + [9] * 260 + [63] * 33
    else:
        slots = _decode_slots(256, 64, seed=12)
    # Each batch kind meets both the aligned (vector-load) and the unaligned path, one per dtype.
    aligned = (batch != "prefill") != (dtype == torch.bfloat16)
    _run(slots, 64, k, mods, outs, [0, 8, 16, 64, 128], dtype, seed=13, aligned=aligned,
         block_m=ROW_BLOCK_M if batch == "rows" else None)


@pytest.mark.skipif(not ON_GPU, reason="counts compiled variants: needs the GPU")
def test_new_batch_shapes_compile_no_new_variant() -> None:
    """Decode batches of every size (so every K-split count) reuse the compiled shrinks and
    expands: split counts and buffer strides are runtime values, not specializations. What is
    compiled per choice: tokens grouped by adapter or interleaved (read through the sorted row
    list), and 16-row tiles or taller ones for segments past 16 rows (an interleaved batch of
    100 rows over 8 adapters sorts into such segments; H200, 4a1c7c8 and 8a01c2c)."""
    from slora_kernels.jit_stats import compiled_kernel_variants

    for batch in (8, 255):  # short segments (16-row tiles), then long ones (taller tiles)
        warm = _decode_slots(batch, 8, seed=1)
        for slots in (warm, sorted(warm)):  # interleaved, then grouped
            _run(slots, 8, 256, QKV, (256, 64, 64), [16], torch.float16, seed=2, aligned=True)
    _run(_decode_slots(8, 8, seed=1), 8, 256, QKV, (256, 64, 64), [16], torch.float16,
         seed=2, aligned=True, block_m=ROW_BLOCK_M)  # the row kernels
    before = compiled_kernel_variants()
    for batch in (1, 3, 17, 40, 100, 255):
        for block_m in (None, ROW_BLOCK_M):
            _run(_decode_slots(batch, 8, seed=batch), 8, 256, QKV, (256, 64, 64), [16],
                 torch.float16, seed=batch, aligned=True, block_m=block_m)
    assert compiled_kernel_variants() == before


# Every pair of (split_k, aligned, balanced) values meets in the default suite's six cases;
# the other six of the full product run with the slow set (each is a few seconds of fp16 on
# Triton's interpreter).
PAIRWISE = {(None, False, False), (None, True, True), (1, False, True), (1, True, False),
            (3, False, True), (3, True, False)}
ROW_QKV_CASES = [pytest.param(k, a, b, marks=() if (k, a, b) in PAIRWISE else pytest.mark.slow,
                              id=f"{b}-{a}-{k}")
                 for k in (None, 1, 3) for a in (False, True) for b in (False, True)]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("split_k,aligned,balanced", ROW_QKV_CASES)
def test_row_kernels_mixed_ranks_qkv(dtype: torch.dtype, split_k: int | None,
                                     aligned: bool, balanced: bool) -> None:
    """The row kernels (one token a program, its slot read directly): ranks below, at and
    above the rank tile (128 loops two 64-wide tiles), base rows, unaligned matrices; K
    splits the same for every rank or rank-balanced (the default)."""
    slots = _decode_slots(12, 6, seed=31)
    # A 256-element register tile: K tiles of 16 columns, so 3 splits each read two.
    _run(slots, 6, 96, QKV, (64, 32, 32), [1, 8, 16, 33, 64, 128], dtype, seed=32,
         aligned=aligned, split_k=split_k, max_rank=128, block_m=ROW_BLOCK_M,
         tiles=RowTiles(tile=256, block_n=32, rank_balanced=balanced))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("split_k", [None, pytest.param(4, marks=pytest.mark.slow), 7])
def test_row_kernels_rank_balanced_splits(dtype: torch.dtype, split_k: int | None) -> None:
    """RowTiles.rank_balanced: rows of rank <= 16 and <= 32 in a launch of rank tile 64 write
    a quarter and a half of the splits (at least one), each K chunk as long as a rank-64
    row's; the expand sums only those. Odd splits leave ragged shares (7 -> 1, 3, 7)."""
    tiles = RowTiles(tile=256, block_n=32, rank_balanced=True)
    _run(_decode_slots(12, 6, seed=43), 6, 200, QKV, (64, 32, 32), [1, 8, 16, 24, 33, 64, 128],
         dtype, seed=44, split_k=split_k, max_rank=128, block_m=ROW_BLOCK_M, tiles=tiles)


def test_rank_balanced_shrink_writes_each_row_its_share_of_the_splits() -> None:
    """With rank_balanced, a rank-8 row in a rank-64 launch of 8 splits writes 2 splits, a
    rank-32 row 4 and a rank-64 row all 8, each over an equal K chunk; the rest of the
    buffer is left as it was (NaN here)."""
    from slora_kernels.lora_rows import rows_shrink

    gen = generator(45)
    ranks = [8, 32, 64]
    case = build_lora_case([0, 1, 2], 3, 512, {0: 16}, {(i, 0): r for i, r in enumerate(ranks)},
                           torch.float16, gen, aligned=True, block_m=ROW_BLOCK_M)
    x = randn(3, 512, dtype=torch.float16, gen=gen)
    buf = torch.full((8, 3, 1, 64), float("nan"), dtype=torch.float32, device=DEVICE)
    slots = torch.tensor([0, 1, 2], dtype=torch.int32, device=DEVICE)
    rows_shrink(buf, x, case.arena, case.a_offsets, case.ranks, (0,), slots, block_r=64,
                tile=256, rank_balanced=True)
    for row, (rank, share) in enumerate(zip(ranks, (2, 4, 8), strict=True)):
        written = buf[:, row, 0, :rank].isfinite().all(dim=1)
        assert written.tolist() == [True] * share + [False] * (8 - share), (rank, written)
        a = case.arena[int(case.a_offsets[row, 0]):][: rank * 512].view(rank, 512)
        want = x[row].double() @ a.double().T
        assert rel_err(buf[:share, row, 0, :rank].double().sum(0), want) < 1e-3


@pytest.mark.parametrize("dtype", DTYPES)
def test_row_expand_sub_tiles(dtype: torch.dtype) -> None:
    """The expand's capped register tile: 64 columns a program looped 16 (rank tile 32 and
    64) or 32 (16) at a time, over slices whose widths are not multiples of either."""
    tiles = RowTiles(tile=256, block_n=64, expand_sub_tile=512)
    _run(_decode_slots(12, 6, seed=39), 6, 64, QKV, (72, 40, 24), [1, 8, 16, 33, 64, 128],
         dtype, seed=40, split_k=2, max_rank=128, block_m=ROW_BLOCK_M, tiles=tiles)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows", [11, 12])
def test_row_expand_wide_columns_from_a_row_count(dtype: torch.dtype, rows: int,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """Launches of `wide_min_rows` rows or more run `wide_block_n` columns a program, fewer
    rows `block_n`; both cover slices whose widths are not multiples of either."""
    import slora_kernels.lora as lora

    widths: list[int] = []
    real = lora.rows_expand

    def spy(*args: object, **kwargs: object) -> None:
        widths.append(int(kwargs["block_n"]))  # type: ignore[call-overload]
        real(*args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(lora, "rows_expand", spy)
    tiles = RowTiles(tile=256, block_n=16, wide_block_n=64, wide_min_rows=12)
    _run(_decode_slots(rows, 6, seed=41), 6, 64, QKV, (72, 40, 24), [1, 8, 16, 33, 64],
         dtype, seed=42, split_k=2, max_rank=64, block_m=ROW_BLOCK_M, tiles=tiles)
    assert widths == [64 if rows >= 12 else 16]


@pytest.mark.parametrize("dtype", DTYPES)
def test_row_kernels_interleaved_shared_adapters_and_many_modules(dtype: torch.dtype) -> None:
    """Rows need no grouping: an adapter's rows may be anywhere. Four modules take two
    launches; rank 0 marks modules an adapter does not target."""
    slots = [2, 0, 2, -1, 1, 0, 2, 2, -1, 3, 1, 0, 0]
    _run(slots, 4, 48, (0, 1, 2, 3), (32, 16, 16, 48), [0, 4, 16, 24], dtype, seed=33,
         block_m=ROW_BLOCK_M, tiles=RowTiles(tile=256, block_n=16))


def test_row_and_tile_metas_refuse_the_other_tiles() -> None:
    gen = generator(36)
    case = build_lora_case([0, 0], 1, 16, {0: 16}, {(0, 0): 4}, torch.float32, gen,
                           block_m=ROW_BLOCK_M)
    x = randn(2, 16, dtype=torch.float32, gen=gen)
    y = randn(2, 16, dtype=torch.float32, gen=gen)
    args = (case.arena, case.a_offsets, case.b_offsets, case.ranks, case.scales, (0,),
            ((0, 16),))
    with pytest.raises(ValueError, match="RowTiles"):
        add_lora_triton(y, x, *args, case.meta, tiles=DECODE_TILES)
    tile_meta = build_lora_case([0, 0], 1, 16, {0: 16}, {(0, 0): 4}, torch.float32, gen).meta
    with pytest.raises(ValueError, match="row-kernel meta"):
        add_lora_triton(y, x, *args, tile_meta, tiles=RowTiles())


def test_segments_and_tile_list() -> None:
    """Runs of equal slots >= 0 are segments; each is cut into block_m-row tiles, so one
    adapter shared by many decode rows is read once per tile, not once per row."""
    import numpy as np

    from slora_kernels.lora_meta import lora_segments, lora_tile_count, lora_tiles

    slots = np.array([2, 2, 2, 2, 2, -1, -1, 0, 5, 5, 5, 5, 5, 5, 5, 5, 5, 5, 5, 5, 5, 5, 5, 5, 5])
    starts, lens, seg_slots = lora_segments(slots)
    assert starts.tolist() == [0, 7, 8] and lens.tolist() == [5, 1, 17]
    assert seg_slots.tolist() == [2, 0, 5]
    segs, m0 = lora_tiles(lens, 16)
    assert segs.tolist() == [0, 1, 2, 2] and m0.tolist() == [0, 0, 0, 16]
    segs, m0 = lora_tiles(lens, 4)
    assert segs.tolist() == [0, 0, 1, 2, 2, 2, 2, 2] and m0.tolist() == [0, 4, 0, 0, 4, 8, 12, 16]
    assert lora_tiles(np.zeros(0, dtype=np.int64), 16)[0].size == 0
    # The count decode graphs pick their list by, without building the list.
    assert [lora_tile_count(lens, m) for m in (16, 4)] == [4, 8]
    assert lora_tile_count(np.zeros(0, dtype=np.int64), 16) == 0


def test_a_padded_tile_list_runs_only_its_real_tiles() -> None:
    """CUDA graphs capture a fixed-size tile list; entries marked -1 must do nothing."""
    slots = [1] * 20 + [0] * 3
    gen = generator(21)
    rank_of = {(s, m): 8 for s in range(2) for m in O_PROJ}
    case = build_lora_case(slots, 2, 32, {3: 24}, rank_of, torch.float32, gen, block_m=16)
    pad = torch.full((5,), -1, dtype=torch.int32, device=DEVICE)
    meta = dataclasses.replace(
        case.meta, tile_segs=torch.cat([case.meta.tile_segs, pad]),
        tile_m0=torch.cat([case.meta.tile_m0, torch.zeros_like(pad)]),
        num_tiles=case.meta.num_tiles + 5)
    x = randn(len(slots), 32, dtype=torch.float32, gen=gen)
    args = (case.arena, case.a_offsets, case.b_offsets, case.ranks, case.scales, O_PROJ,
            ((0, 24),))
    y_ref = torch.zeros(len(slots), 24, device=DEVICE, dtype=torch.float64)
    add_lora_reference(y_ref, x.double(), case.arena.double(), *args[1:], case.meta)
    y = torch.zeros(len(slots), 24, device=DEVICE)
    add_lora_triton(y, x, *args, meta, tiles=DECODE_TILES)  # type: ignore[arg-type]
    assert rel_err(y, y_ref) < TOLERANCE[torch.float32]
