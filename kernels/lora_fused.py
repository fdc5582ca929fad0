"""Fused multi-LoRA delta: shrink and expand in one launch per module group, no intermediate.

Same signature and semantics as `kernels.lora.add_lora_triton` (and so as
`kernels.lora_reference.add_lora_reference`): for every segment s, every module index i with
m = module_ids[i], (o_start, N) = out_slices[i] and r = min(ranks[slot_s, m], max_rank) > 0,

    A = arena[a_offsets[slot_s, m] : + r * K].view(r, K)
    B = arena[b_offsets[slot_s, m] : + N * r].view(N, r)
    y[tokens of s, o_start : o_start + N] += scales[slot_s, m] * (x[tokens of s] @ A.T) @ B.T

in float32 math, y + delta rounded once to y's dtype. Tokens of no segment and modules of
rank 0 are left untouched.

The grid is (row tile of the step's tile list, module x output-column tile). Each program
computes its rows' shrink h = x[rows] @ A.T over the whole K loop in float32 registers, then
writes y[rows, cols] + scale * h @ B[cols].T: the shrink is recomputed once per column tile
instead of being written to a float32 buffer and read back by a second launch. That suits
decode steps where few adapters cover many rows (one launch instead of two, no buffer); with
many adapters, or long K, the two-launch path's K split spreads the shrink over more programs.

Shapes: y [T, N_total] (any strides, updated in place); x [T, K] (any strides); arena 1-D;
a_offsets/b_offsets [num_slots, num_modules] int64, ranks int32, scales float32 (contiguous).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from kernels.lora import rank_block
from kernels.lora_common import (
    MAX_MODULES_PER_LAUNCH,
    check_rows,
    check_scales,
    check_slices,
    check_tables,
    dot_precision,
    segment_rows,
    select3,
)
from kernels.lora_meta import DECODE_BLOCK_M, PREFILL_BLOCK_M, LoraMeta


@dataclass(frozen=True)
class FusedTiles:
    """Block sizes of the fused kernel (powers of two, >= 16: they all feed tl.dot)."""

    block_m: int  # rows per tile: must match the step's tile list (LoraMeta.block_m)
    block_n: int  # output columns per program
    block_k: int  # K step of the shrink loop
    num_warps: int = 4
    num_stages: int = 2
    # Segments of rank <= 16 (<= 32) run 16- (32-) wide rank tiles instead of the launch's.
    rank_buckets: bool = True


# Not yet measured on a GPU: 128-wide column tiles give a 4096-wide module 32 programs per
# row tile (the shrink each one repeats is the same length whatever the width).
FUSED_DECODE_TILES = FusedTiles(block_m=DECODE_BLOCK_M, block_n=128, block_k=256)
FUSED_PREFILL_TILES = FusedTiles(block_m=PREFILL_BLOCK_M, block_n=128, block_k=128)


def pick_fused_tiles(block_m: int) -> FusedTiles:
    """The tile table entry for a step whose tile list has `block_m` rows per tile."""
    return FUSED_DECODE_TILES if block_m == DECODE_BLOCK_M else FUSED_PREFILL_TILES


@triton.jit
def _fused_rank_tiles(
    x_ptr, a_base, b_base, y_ptrs, y_mask, tokens, mask_m, offs_n, mask_n, rank, scale, K,
    stride_xm, stride_xk,
    SHRINK_PRECISION: tl.constexpr, EXPAND_PRECISION: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr,
):
    """y[rows, cols] += scale * (x[rows] @ A[:rank].T) @ B[cols, :rank].T, rank tile by rank
    tile: each tile's shrink runs the whole K loop, then meets its slice of B."""
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for r0 in range(0, rank, BLOCK_R):
        offs_r = r0 + tl.arange(0, BLOCK_R)
        mask_r = offs_r < rank
        h = tl.zeros((BLOCK_M, BLOCK_R), dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            offs_k = k0 + tl.arange(0, BLOCK_K)
            mask_k = offs_k < K
            x_tile = tl.load(
                x_ptr + tokens[:, None] * stride_xm + offs_k[None, :] * stride_xk,
                mask=mask_m[:, None] & mask_k[None, :], other=0.0,
            )
            # A is [r, K] row-major; this tile is A.T[k0:k0+BLOCK_K, r0:r0+BLOCK_R].
            a_tile = tl.load(a_base + offs_r[None, :] * K + offs_k[:, None],
                             mask=mask_r[None, :] & mask_k[:, None], other=0.0)
            h += tl.dot(x_tile, a_tile, input_precision=SHRINK_PRECISION)
        # B is [N, r] row-major; this tile is B.T[r0:r0+BLOCK_R, n0:n0+BLOCK_N]. Masked ranks
        # read 0 here and in A, so h's padding columns add nothing.
        b_tile = tl.load(b_base + offs_n[None, :] * rank + offs_r[:, None],
                         mask=mask_n[None, :] & mask_r[:, None], other=0.0)
        acc += tl.dot(h, b_tile.to(tl.float32), input_precision=EXPAND_PRECISION)
    y_old = tl.load(y_ptrs, mask=y_mask, other=0.0)
    tl.store(y_ptrs, (y_old.to(tl.float32) + acc * scale).to(y_ptrs.dtype.element_ty),
             mask=y_mask)


@triton.jit
def _fused_bucketed(
    x_ptr, a_base, b_base, y_ptrs, y_mask, tokens, mask_m, offs_n, mask_n, rank, scale, K,
    stride_xm, stride_xk,
    SHRINK_PRECISION: tl.constexpr, EXPAND_PRECISION: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr,
    RANK_BUCKETS: tl.constexpr,
):
    """`_fused_rank_tiles` with the narrowest rank tile (16, 32 or BLOCK_R) covering `rank`."""
    if RANK_BUCKETS and BLOCK_R > 16 and rank <= 16:
        _fused_rank_tiles(x_ptr, a_base, b_base, y_ptrs, y_mask, tokens, mask_m, offs_n,
                          mask_n, rank, scale, K, stride_xm, stride_xk, SHRINK_PRECISION,
                          EXPAND_PRECISION, BLOCK_M, BLOCK_N, 16, BLOCK_K)
    elif RANK_BUCKETS and BLOCK_R > 32 and rank <= 32:
        _fused_rank_tiles(x_ptr, a_base, b_base, y_ptrs, y_mask, tokens, mask_m, offs_n,
                          mask_n, rank, scale, K, stride_xm, stride_xk, SHRINK_PRECISION,
                          EXPAND_PRECISION, BLOCK_M, BLOCK_N, 32, BLOCK_K)
    else:
        _fused_rank_tiles(x_ptr, a_base, b_base, y_ptrs, y_mask, tokens, mask_m, offs_n,
                          mask_n, rank, scale, K, stride_xm, stride_xk, SHRINK_PRECISION,
                          EXPAND_PRECISION, BLOCK_M, BLOCK_N, BLOCK_R, BLOCK_K)


# n_tiles changes with the module group's widest slice, not with the batch; nothing here
# depends on the batch size but the grid, so a new batch shape compiles no new variant.
@triton.jit
def _lora_fused_kernel(
    y_ptr, x_ptr, arena_ptr, a_off_ptr, b_off_ptr, ranks_ptr, scales_ptr,
    seg_starts_ptr, seg_lens_ptr, seg_slots_ptr, tile_segs_ptr, tile_m0_ptr, rows_ptr,
    mod0, mod1, mod2, start0, start1, start2, size0, size1, size2,
    n_tiles, K, stride_xm, stride_xk, stride_ym, stride_yn, table_stride,
    MAX_RANK: tl.constexpr, SHRINK_PRECISION: tl.constexpr, EXPAND_PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr,
    BLOCK_K: tl.constexpr, RANK_BUCKETS: tl.constexpr, GATHER_ROWS: tl.constexpr,
):
    tile = tl.program_id(0)
    mod_i = tl.program_id(1) // n_tiles
    n0 = (tl.program_id(1) % n_tiles) * BLOCK_N
    out_size = select3(mod_i, size0, size1, size2)
    if n0 >= out_size:
        return
    seg = tl.load(tile_segs_ptr + tile)
    if seg < 0:
        return
    m0 = tl.load(tile_m0_ptr + tile)
    seg_len = tl.load(seg_lens_ptr + seg)
    start = tl.load(seg_starts_ptr + seg)
    slot = tl.load(seg_slots_ptr + seg).to(tl.int64)
    mod = select3(mod_i, mod0, mod1, mod2)
    rank = tl.minimum(tl.load(ranks_ptr + slot * table_stride + mod), MAX_RANK)
    if rank <= 0:
        return
    a_off = tl.load(a_off_ptr + slot * table_stride + mod)
    b_off = tl.load(b_off_ptr + slot * table_stride + mod)
    scale = tl.load(scales_ptr + slot * table_stride + mod)

    offs_m = m0 + tl.arange(0, BLOCK_M)
    mask_m = offs_m < seg_len
    tokens = segment_rows(rows_ptr, start + offs_m, mask_m, GATHER_ROWS)
    offs_n = n0 + tl.arange(0, BLOCK_N)
    mask_n = offs_n < out_size
    o_start = select3(mod_i, start0, start1, start2)
    y_ptrs = y_ptr + tokens[:, None] * stride_ym + (o_start + offs_n)[None, :] * stride_yn
    y_mask = mask_m[:, None] & mask_n[None, :]
    if (a_off % 8 == 0) & (b_off % 8 == 0) & (rank % 8 == 0):
        # The page packer puts matrices at multiples of 8 elements whenever the model's sizes
        # are; `// 8 * 8` shows the compiler that alignment: 16-byte A and B loads.
        _fused_bucketed(x_ptr, arena_ptr + a_off // 8 * 8, arena_ptr + b_off // 8 * 8, y_ptrs,
                        y_mask, tokens, mask_m, offs_n, mask_n, rank // 8 * 8, scale, K,
                        stride_xm, stride_xk, SHRINK_PRECISION, EXPAND_PRECISION,
                        BLOCK_M, BLOCK_N, BLOCK_R, BLOCK_K, RANK_BUCKETS)
    else:
        _fused_bucketed(x_ptr, arena_ptr + a_off, arena_ptr + b_off, y_ptrs, y_mask, tokens,
                        mask_m, offs_n, mask_n, rank, scale, K, stride_xm, stride_xk,
                        SHRINK_PRECISION, EXPAND_PRECISION, BLOCK_M, BLOCK_N, BLOCK_R,
                        BLOCK_K, RANK_BUCKETS)


def add_lora_fused(
    y: torch.Tensor,
    x: torch.Tensor,
    arena: torch.Tensor,
    a_offsets: torch.Tensor,
    b_offsets: torch.Tensor,
    ranks: torch.Tensor,
    scales: torch.Tensor,
    module_ids: tuple[int, ...],
    out_slices: tuple[tuple[int, int], ...],
    meta: LoraMeta,
    *,
    max_rank: int | None = None,
    tiles: FusedTiles | None = None,
) -> None:
    """y += the multi-LoRA delta of x, as `add_lora_reference` defines it, one launch per
    group of up to MAX_MODULES_PER_LAUNCH modules.

    `max_rank` must bound every rank in the tables (the engine's `max_rank`; larger ranks are
    clipped to it); without it the launcher reads `ranks.max()`, a host sync that CUDA-graph
    capture forbids. `tiles` overrides the table's choice for the step's tile height.
    """
    if len(module_ids) != len(out_slices):
        raise ValueError(f"{len(module_ids)} modules but {len(out_slices)} output slices")
    if meta.num_tiles == 0 or x.shape[0] == 0:
        return
    check_rows(x, y, meta)
    if max_rank is None:
        max_rank = int(ranks.max())
    if max_rank <= 0:
        return
    check_slices(y, module_ids, out_slices)
    check_tables(arena, x, a_offsets, ranks)
    check_tables(arena, y, b_offsets, ranks, float32_x=True)
    check_scales(scales, ranks)
    tiles = tiles or pick_fused_tiles(meta.block_m)
    if tiles.block_m != meta.block_m:
        raise ValueError(f"tiles of {tiles.block_m} rows but the step's tile list has "
                         f"{meta.block_m}")
    block_r = rank_block(max_rank)
    for g in range(0, len(module_ids), MAX_MODULES_PER_LAUNCH):
        mods = tuple(module_ids[g : g + MAX_MODULES_PER_LAUNCH])
        slices = tuple(out_slices[g : g + MAX_MODULES_PER_LAUNCH])
        pad = (0,) * (MAX_MODULES_PER_LAUNCH - len(mods))
        mods_p = mods + pad
        starts = tuple(s for s, _ in slices) + pad
        sizes = tuple(n for _, n in slices) + pad
        n_tiles = triton.cdiv(max(sizes), tiles.block_n)
        _lora_fused_kernel[(meta.num_tiles, len(mods) * n_tiles)](
            y, x, arena, a_offsets, b_offsets, ranks, scales,
            meta.seg_starts, meta.seg_lens, meta.seg_slots, meta.tile_segs, meta.tile_m0,
            meta.rows_or_slots(), mods_p[0], mods_p[1], mods_p[2],
            starts[0], starts[1], starts[2], sizes[0], sizes[1], sizes[2],
            n_tiles, x.shape[1], x.stride(0), x.stride(1), y.stride(0), y.stride(1),
            a_offsets.stride(0),
            MAX_RANK=max_rank, SHRINK_PRECISION=dot_precision(x.dtype),
            EXPAND_PRECISION=dot_precision(arena.dtype), BLOCK_M=tiles.block_m,
            BLOCK_N=tiles.block_n, BLOCK_R=block_r, BLOCK_K=tiles.block_k,
            RANK_BUCKETS=tiles.rank_buckets, GATHER_ROWS=meta.token_rows is not None,
            num_warps=tiles.num_warps, num_stages=tiles.num_stages,
        )
