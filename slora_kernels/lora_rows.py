"""Multi-LoRA delta one token row at a time: for decode steps whose adapters own a row or few.

The tile kernels (`lora_shrink`, `lora_expand`) read each adapter once per 16-row tile of its
segment, through a tile list, a segment table and tensor-core dots. When nearly every row has
its own adapter, those tiles hold one real row each: every program then walks four dependent
table loads (tile, segment, slot, offsets) before its first byte of adapter, and the dot's
operands go through shared memory for one row. The row kernels here index the adapter slot
of each token directly (`LoraMeta.token_slots`), two dependent loads deep, and multiply
in registers (products of 16-bit values are exact in float32, sums in float32, like the dots'
accumulators). Rows that share an adapter re-read it, mostly from the L2.

Same semantics as `slora_kernels.lora_reference.add_lora_reference` (the segment tables are not
read: only `token_slots`, so the row order does not matter):

    shrink: buf[j, t, i, :r] = x[t, K-chunk j] @ A[:r, K-chunk j].T            (float32)
    expand: y[t, slice_i] += scales[slot_t, m] * (sum_j buf[j, t, i, :r]) @ B.T
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from slora_kernels.lora_common import (
    MAX_MODULES_PER_LAUNCH,
    check_buf,
    check_scales,
    check_slices,
    check_tables,
    pdl_options,
    release_dependents,
    select3,
    wait_for_producer,
)


@dataclass(frozen=True)
class RowTiles:
    """Tile sizes of the row kernels: the shrink's register tile (elements), the expand's
    output columns per program, warps per program, the most K splits and the shrink programs
    per multiprocessor the K split aims for. Defaults: the best of the first H200 sweep at the
    engine's decode case, r16 adapters in launches bounded at rank 64, B64 U64 (15.1 vs 19.5
    us for 4096-element tiles, 128 columns, 4 warps; that round, 7f5673f, was superseded and
    not kept); within 1-2 us of the best in every case of lora-rows-sweep-964ec9e-h200.json
    but one (one warp, 2.4 us faster at r16 in rank-64 launches, 1.5x slower at r64)."""

    # Elements of the shrink's register tile ([rank tile, K tile]) a program multiplies per
    # step: the K tile is tile // rank tile, so every rank bucket moves the same bytes a step.
    tile: int = 2048
    block_n: int = 256
    num_warps: int = 2
    max_split_k: int = 16
    programs_per_sm: int = 4
    # The expand's register tile capped at this many elements (0: none): a rank bucket's
    # block_n columns are looped sub_tile // rank tile at a time. In launches bounded at rank
    # 64 (the engine's) 4096 is as fast or faster than no cap (r16 B64 U64 13.0 vs 14.7 us,
    # r8 B256 U256 25.7 vs 32.9, r64 B64 U64 32.4 vs 34.8; rank-16 bounds within 0.1 us:
    # lora-rows-sweep-fd01907-h200.json), and the rank-64 expand compiles to 0.83 MB of PTX in
    # 6.6 s instead of 2.0 MB in 13.2 s (kernel-compile-cost-cpu.json, compiled unspecialized;
    # as a launch specializes it, 0.21 MB in 1.0 s against 0.40 MB in 2.0 s,
    # kernel-compile-cost-ebb16eb-cpu.json).
    expand_sub_tile: int = 4096
    # Launches of at least wide_min_rows rows run wide_block_n expand columns a program
    # (half the programs, each re-reading its row's partial sums half as often): at 256 rows
    # 512 beat 256 (r16 U256 25.3 vs 26.3 us, r16 U64 19.8 vs 21.0, r8 U256 in rank-64
    # launches 21.4 vs 22.9), at 64 rows it lost (r16 U64 11.9 vs 10.5, r64 U64 32.2 vs
    # 29.4) (lora-rows-sweep-pdl-59cd9b2-h200.json). 128 rows were not measured.
    wide_block_n: int = 512
    wide_min_rows: int = 256
    # Programmatic dependent launch (Hopper+; see `slora_kernels.lora.LoraTiles.pdl`): 1-2.5 us a
    # launch on the H200 (r16 B64 U64 12.7 -> 10.5 us, lora-grid-pdl-dccb3ce-h200.json).
    pdl: bool = True
    # Each row's K splits in proportion to its rank bucket (16, 32 or the launch's rank tile):
    # a row of a rank-16 adapter in a rank-64 launch reads its A in a quarter of the splits,
    # each as long as a rank-64 row's, so every program moves the same bytes (mixed ranks
    # otherwise leave the rank-64 rows' programs running long after the others). The
    # programs past a row's share exit at once; the split is chosen for 4x the programs
    # under 4x the caps (`slora_kernels.lora.row_split_k`), so a launch of one rank keeps
    # its width. H100, one 7B decode layer's LoRA (8 launches), 64 rows on 64 adapters of
    # ranks 8-64 in a rank-64 launch: 192.0 -> 154.4 us (floor 106.4); 64 rank-16 adapters
    # 85.1 -> 86.7 (lora-distinct-layer-balanced-4cf2572-h100.json).
    rank_balanced: bool = True


@triton.jit
def active_splits(rank, split_k, BLOCK_R: tl.constexpr, BALANCED: tl.constexpr):
    """The K splits a row of this rank uses (`RowTiles.rank_balanced`): all of them, or
    (BALANCED) its rank bucket's share (16, 32 or BLOCK_R wide, as the bucketed register
    tiles run it), at least one. Every used split then reads the same bytes of A, whatever
    the rank; the expand sums only these."""
    if BALANCED:
        bucket = tl.where(rank <= 16, 16, tl.where(rank <= 32, 32, BLOCK_R))
        return tl.maximum(1, split_k * bucket // BLOCK_R)
    else:
        return split_k


@triton.jit
def _rows_shrink_tiles(x_row, a_base, buf_row, rank, k_lo, k_hi, K, stride_xk,
                       BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr):
    """buf_row[:rank] = x_row[k_lo:k_hi] @ A[:rank, k_lo:k_hi].T, rank tile by rank tile."""
    for r0 in range(0, rank, BLOCK_R):
        offs_r = r0 + tl.arange(0, BLOCK_R)
        mask_r = offs_r < rank
        acc = tl.zeros((BLOCK_R, BLOCK_K), dtype=tl.float32)
        for k0 in range(k_lo, k_hi, BLOCK_K):
            offs_k = k0 + tl.arange(0, BLOCK_K)
            mask_k = offs_k < k_hi
            xv = tl.load(x_row + offs_k * stride_xk, mask=mask_k, other=0.0)
            a = tl.load(a_base + offs_r[:, None] * K + offs_k[None, :],
                        mask=mask_r[:, None] & mask_k[None, :], other=0.0)
            acc += a.to(tl.float32) * xv.to(tl.float32)[None, :]
        tl.store(buf_row + offs_r, tl.sum(acc, axis=1), mask=mask_r)


@triton.jit
def _rows_shrink_bucketed(x_row, a_base, buf_row, rank, k_lo, k_hi, K, stride_xk,
                          BLOCK_R: tl.constexpr, TILE: tl.constexpr):
    """`_rows_shrink_tiles` with the narrowest rank tile (16, 32 or BLOCK_R) covering `rank`,
    its K tile TILE // rank tile wide."""
    if BLOCK_R > 16 and rank <= 16:
        _rows_shrink_tiles(x_row, a_base, buf_row, rank, k_lo, k_hi, K, stride_xk,
                           16, TILE // 16)
    elif BLOCK_R > 32 and rank <= 32:
        _rows_shrink_tiles(x_row, a_base, buf_row, rank, k_lo, k_hi, K, stride_xk,
                           32, TILE // 32)
    else:
        _rows_shrink_tiles(x_row, a_base, buf_row, rank, k_lo, k_hi, K, stride_xk,
                           BLOCK_R, TILE // BLOCK_R)


# Module count and split change with the step: runtime values, never specialized on, so a new
# batch shape compiles no new variant (the row count is the grid's).
@triton.jit(do_not_specialize=["num_mods", "split_k", "k_chunk", "stride_bs"])
def _rows_shrink_kernel(
    x_ptr, arena_ptr, buf_ptr, a_off_ptr, ranks_ptr, slots_ptr,
    mod0, mod1, mod2, num_mods, split_k, k_chunk,
    K, stride_xm, stride_xk, table_stride, stride_bs, stride_bt, stride_bm,
    MAX_RANK: tl.constexpr, BLOCK_R: tl.constexpr, TILE: tl.constexpr,
    LAUNCH_DEPENDENTS: tl.constexpr, BALANCED: tl.constexpr,
):
    release_dependents(LAUNCH_DEPENDENTS)
    # Work item (row, module, K split); a row's splits are adjacent so they share x in the L2.
    w = tl.program_id(0)
    split = w % split_k
    mod_i = w // split_k % num_mods
    row = (w // split_k // num_mods).to(tl.int64)
    slot = tl.load(slots_ptr + row).to(tl.int64)
    mod = select3(mod_i, mod0, mod1, mod2)
    rank = tl.minimum(tl.load(ranks_ptr + slot * table_stride + mod, mask=slot >= 0, other=0),
                      MAX_RANK)
    active = active_splits(rank, split_k, BLOCK_R, BALANCED)
    if BALANCED:
        # Whole K tiles of the widest bucket's (TILE // 16), as the host's k_chunk.
        k_chunk = tl.cdiv(tl.cdiv(K, TILE // 16), active) * (TILE // 16)
    if (rank > 0) & (split < active):
        a_off = tl.load(a_off_ptr + slot * table_stride + mod)
        k_lo = split * k_chunk
        k_hi = tl.minimum(k_lo + k_chunk, K)
        buf_row = buf_ptr + split * stride_bs + row * stride_bt + mod_i * stride_bm
        x_row = x_ptr + row * stride_xm
        if a_off % 8 == 0:
            # 16-byte A loads when the packer aligned the matrix (`// 8 * 8` shows it).
            _rows_shrink_bucketed(x_row, arena_ptr + a_off // 8 * 8, buf_row, rank, k_lo, k_hi,
                                  K, stride_xk, BLOCK_R, TILE)
        else:
            _rows_shrink_bucketed(x_row, arena_ptr + a_off, buf_row, rank, k_lo, k_hi, K,
                                  stride_xk, BLOCK_R, TILE)


@triton.jit
def _rows_expand_tiles(y_row, buf_row, b_base, rank, scale, n0, out_size, stride_yn,
                       stride_bs, split_k, BLOCK_R: tl.constexpr, BLOCK_N: tl.constexpr,
                       USE_PDL: tl.constexpr):
    """y_row[n0:n0+BLOCK_N] += scale * (sum of buf's K splits)[:rank] @ B[cols, :rank].T,
    `split_k` being the splits the row's shrink wrote (`active_splits`).
    The loads of y and of the B tile are issued before the K splits are summed, so their
    latency overlaps the sum's: 0.7-2.5 us faster a launch over the sweep's cases (r16 B256
    U256 28.8 vs 31.3 us, lora-rows-bodies-h200.json at 8142e3a). With USE_PDL they may also
    run while the shrink does: only the sum waits for it."""
    offs_n = n0 + tl.arange(0, BLOCK_N)
    mask_n = offs_n < out_size
    y_ptrs = y_row + offs_n * stride_yn
    y_old = tl.load(y_ptrs, mask=mask_n, other=0.0)
    acc = tl.zeros((BLOCK_N,), dtype=tl.float32)
    for r0 in range(0, rank, BLOCK_R):
        offs_r = r0 + tl.arange(0, BLOCK_R)
        mask_r = offs_r < rank
        # B is [N, r] row-major: this tile is B[n0:n0+BLOCK_N, r0:r0+BLOCK_R].
        b = tl.load(b_base + offs_n[:, None] * rank + offs_r[None, :],
                    mask=mask_n[:, None] & mask_r[None, :], other=0.0)
        h = tl.zeros((BLOCK_R,), dtype=tl.float32)
        wait_for_producer(USE_PDL)
        for j in range(split_k):
            h += tl.load(buf_row + j * stride_bs + offs_r, mask=mask_r, other=0.0)
        acc += tl.sum(b.to(tl.float32) * h[None, :], axis=1)
    tl.store(y_ptrs, (y_old.to(tl.float32) + acc * scale).to(y_ptrs.dtype.element_ty),
             mask=mask_n)


@triton.jit
def _rows_expand_cols(y_row, buf_row, b_base, rank, scale, n0, out_size, stride_yn,
                      stride_bs, split_k, BLOCK_R: tl.constexpr, BLOCK_N: tl.constexpr,
                      SUB_N: tl.constexpr, USE_PDL: tl.constexpr):
    """The program's BLOCK_N columns as one tile, or looped SUB_N at a time (a smaller
    register tile: less code, fewer registers)."""
    if SUB_N == BLOCK_N:
        _rows_expand_tiles(y_row, buf_row, b_base, rank, scale, n0, out_size, stride_yn,
                           stride_bs, split_k, BLOCK_R, BLOCK_N, USE_PDL)
    else:
        for s0 in range(0, BLOCK_N, SUB_N):
            _rows_expand_tiles(y_row, buf_row, b_base, rank, scale, n0 + s0, out_size,
                               stride_yn, stride_bs, split_k, BLOCK_R, SUB_N, USE_PDL)


@triton.jit
def _rows_expand_bucketed(y_row, buf_row, b_base, rank, scale, n0, out_size, stride_yn,
                          stride_bs, split_k, BLOCK_R: tl.constexpr, BLOCK_N: tl.constexpr,
                          SUB16: tl.constexpr, SUB32: tl.constexpr, SUBR: tl.constexpr,
                          USE_PDL: tl.constexpr):
    """`_rows_expand_cols` with the narrowest rank tile (16, 32 or BLOCK_R) covering `rank`;
    the N tile stays BLOCK_N (the grid is fixed at launch), looped in the bucket's SUB*
    columns."""
    if BLOCK_R > 16 and rank <= 16:
        _rows_expand_cols(y_row, buf_row, b_base, rank, scale, n0, out_size, stride_yn,
                          stride_bs, split_k, 16, BLOCK_N, SUB16, USE_PDL)
    elif BLOCK_R > 32 and rank <= 32:
        _rows_expand_cols(y_row, buf_row, b_base, rank, scale, n0, out_size, stride_yn,
                          stride_bs, split_k, 32, BLOCK_N, SUB32, USE_PDL)
    else:
        _rows_expand_cols(y_row, buf_row, b_base, rank, scale, n0, out_size, stride_yn,
                          stride_bs, split_k, BLOCK_R, BLOCK_N, SUBR, USE_PDL)


@triton.jit(do_not_specialize=["split_k", "stride_bs"])
def _rows_expand_kernel(
    y_ptr, buf_ptr, arena_ptr, b_off_ptr, ranks_ptr, scales_ptr, slots_ptr,
    mod0, mod1, mod2, start0, start1, start2, size0, size1, size2,
    n_tiles, stride_ym, stride_yn, table_stride, split_k, stride_bs, stride_bt, stride_bm,
    MAX_RANK: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_N: tl.constexpr,
    SUB16: tl.constexpr, SUB32: tl.constexpr, SUBR: tl.constexpr, USE_PDL: tl.constexpr,
    BALANCED: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    mod_i = tl.program_id(1) // n_tiles
    n0 = (tl.program_id(1) % n_tiles) * BLOCK_N
    out_size = select3(mod_i, size0, size1, size2)
    slot = tl.load(slots_ptr + row).to(tl.int64)
    if (n0 < out_size) & (slot >= 0):
        mod = select3(mod_i, mod0, mod1, mod2)
        rank = tl.minimum(tl.load(ranks_ptr + slot * table_stride + mod), MAX_RANK)
        if rank > 0:
            b_off = tl.load(b_off_ptr + slot * table_stride + mod)
            scale = tl.load(scales_ptr + slot * table_stride + mod)
            y_row = y_ptr + row * stride_ym + select3(mod_i, start0, start1, start2) * stride_yn
            buf_row = buf_ptr + row * stride_bt + mod_i * stride_bm
            split_k = active_splits(rank, split_k, BLOCK_R, BALANCED)
            if (b_off % 8 == 0) & (rank % 8 == 0):
                # B rows of a multiple of 8 elements from an aligned base: 16-byte loads.
                _rows_expand_bucketed(y_row, buf_row, arena_ptr + b_off // 8 * 8,
                                      rank // 8 * 8, scale, n0, out_size, stride_yn,
                                      stride_bs, split_k, BLOCK_R, BLOCK_N, SUB16, SUB32,
                                      SUBR, USE_PDL)
            else:
                _rows_expand_bucketed(y_row, buf_row, arena_ptr + b_off, rank, scale, n0,
                                      out_size, stride_yn, stride_bs, split_k, BLOCK_R,
                                      BLOCK_N, SUB16, SUB32, SUBR, USE_PDL)


def rows_shrink(buf: torch.Tensor, x: torch.Tensor, arena: torch.Tensor,
                a_offsets: torch.Tensor, ranks: torch.Tensor, module_ids: tuple[int, ...],
                token_slots: torch.Tensor, *, block_r: int, tile: int = 2048,
                num_warps: int = 4, launch_dependents: bool = False,
                rank_balanced: bool = False) -> None:
    """Write the shrink's partial sums for every row whose slot is >= 0 into `buf`
    [split_k, T, len(module_ids), max_rank] (float32); `block_r` bounds the rank tile.
    `launch_dependents`: let an expand launched with `pdl` start while this runs.
    `rank_balanced` (RowTiles.rank_balanced): a row writes only its rank bucket's share of
    the splits, which `rows_expand` must be told too."""
    split_k, num_rows, num_mods, max_rank = buf.shape
    check_buf(buf, x.shape[0], len(module_ids), f"x {tuple(x.shape)}")
    if not 1 <= num_mods <= MAX_MODULES_PER_LAUNCH:
        raise ValueError(f"1..{MAX_MODULES_PER_LAUNCH} modules per launch, got {module_ids}")
    check_tables(arena, x, a_offsets, ranks)
    _check_slots(token_slots, num_rows)
    if num_rows == 0:
        return
    k = x.shape[1]
    # Whole K tiles of the widest rank bucket's (rank tile 16) per split, so only the last
    # split's last tile is ragged whatever bucket a row runs.
    block_k = tile // 16
    k_chunk = triton.cdiv(triton.cdiv(k, block_k), split_k) * block_k
    mods = tuple(module_ids) + (0,) * (MAX_MODULES_PER_LAUNCH - num_mods)
    _rows_shrink_kernel[(num_rows * num_mods * split_k,)](
        x, arena, buf, a_offsets, ranks, token_slots, mods[0], mods[1], mods[2],
        num_mods, split_k, k_chunk, k, x.stride(0), x.stride(1),
        a_offsets.stride(0), buf.stride(0), buf.stride(1), buf.stride(2),
        MAX_RANK=max_rank, BLOCK_R=block_r, TILE=tile, LAUNCH_DEPENDENTS=launch_dependents,
        BALANCED=rank_balanced and block_r > 16, num_warps=num_warps,
    )


def rows_expand(y: torch.Tensor, buf: torch.Tensor, arena: torch.Tensor,
                b_offsets: torch.Tensor, ranks: torch.Tensor, scales: torch.Tensor,
                module_ids: tuple[int, ...], out_slices: tuple[tuple[int, int], ...],
                token_slots: torch.Tensor, *, block_r: int, block_n: int,
                num_warps: int = 4, sub_tile: int = 0, pdl: bool = False,
                rank_balanced: bool = False) -> None:
    """Add the expand of `buf` into y's column slices for every row whose slot is >= 0.
    `sub_tile` > 0 caps a rank bucket's register tile at that many elements: its `block_n`
    columns are then looped sub_tile // rank tile at a time (0: one tile of block_n). `pdl`
    (where `pdl_supported`): launched as a programmatic dependent of the shrink before it,
    which must write nothing else this reads (slora_kernels.lora.LoraTiles.pdl)."""
    split_k, num_rows, num_mods, max_rank = buf.shape
    check_buf(buf, y.shape[0], len(module_ids), f"y {tuple(y.shape)}")
    if num_mods > MAX_MODULES_PER_LAUNCH:
        raise ValueError(f"1..{MAX_MODULES_PER_LAUNCH} modules per launch, got {module_ids}")
    check_slices(y, module_ids, out_slices)
    check_tables(arena, y, b_offsets, ranks)
    check_scales(scales, ranks)
    _check_slots(token_slots, num_rows)
    if num_rows == 0:
        return
    n_tiles = triton.cdiv(max(size for _, size in out_slices), block_n)
    pad = (0,) * (MAX_MODULES_PER_LAUNCH - num_mods)
    mods = tuple(module_ids) + pad
    starts = tuple(s for s, _ in out_slices) + pad
    sizes = tuple(n for _, n in out_slices) + pad
    _rows_expand_kernel[(num_rows, num_mods * n_tiles)](
        y, buf, arena, b_offsets, ranks, scales, token_slots,
        mods[0], mods[1], mods[2], starts[0], starts[1], starts[2], sizes[0], sizes[1],
        sizes[2], n_tiles, y.stride(0), y.stride(1), b_offsets.stride(0), split_k,
        buf.stride(0), buf.stride(1), buf.stride(2),
        MAX_RANK=max_rank, BLOCK_R=block_r, BLOCK_N=block_n,
        **expand_sub_tiles(block_n, block_r, sub_tile), USE_PDL=pdl,
        BALANCED=rank_balanced and block_r > 16, num_warps=num_warps, **pdl_options(pdl),
    )


def expand_sub_tiles(block_n: int, block_r: int, sub_tile: int) -> dict[str, int]:
    """The expand's columns per sub-tile for the rank buckets 16, 32 and `block_r` (its
    SUB16 / SUB32 / SUBR): `block_n` uncapped (sub_tile 0), else sub_tile // rank tile, at
    least 16."""
    def sub(rank_tile: int) -> int:
        return block_n if sub_tile <= 0 else max(16, min(block_n, sub_tile // rank_tile))
    return {"SUB16": sub(16), "SUB32": sub(32), "SUBR": sub(block_r)}


def _check_slots(token_slots: torch.Tensor, num_rows: int) -> None:
    if (token_slots.dtype != torch.int32 or token_slots.dim() != 1
            or token_slots.shape[0] != num_rows):
        raise ValueError(f"token_slots must be int32 [{num_rows}], got {token_slots.dtype} "
                         f"{tuple(token_slots.shape)}")
