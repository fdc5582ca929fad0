"""Fused multi-LoRA shrink+expand for decode-sized steps: one launch instead of two.

Same semantics as `kernels.lora.add_lora_triton` (y[:, slice] += scale * (x @ A.T) @ B.T per
adapter segment, several modules in one launch, rows of no segment and modules of rank 0
untouched). Each program owns one (row tile, module, output tile): it computes its rows'
x @ A.T over the whole K itself, rank tile by rank tile, and multiplies straight into its
output tile; the float32 intermediate never leaves registers. Programs of one row tile repeat
the shrink (once per output tile): the price of skipping the second launch and the round trip
of the intermediate. A U=1 decode LoRA costs 6.6-12 us as two launches on the H200
(lora-grid-h200-8d70290.log), about four projections x 32 layers x ~9 us of a ~12 ms
Llama-2-7B step; this is the variant to measure against that (bench/kernels_lora_grid.py,
`fused`). It is not used by the engine until it is measured to win.

With one output tile per module the shrink is not repeated; with `block_k` equal to the
shrink's and no K split, the float32 sums are added in the same order as the two-launch path.
"""

from __future__ import annotations

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
    select3,
)
from kernels.lora_meta import LoraMeta


@triton.jit
def _fused_rank_tiles(
    x_ptr, a_base, b_base, tokens, mask_m, rank, K, stride_xm, stride_xk, offs_n, mask_n,
    DOT_PRECISION: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr,
):
    """(x[tokens] @ A[:rank].T) @ B[cols, :rank].T in float32, rank tile by rank tile."""
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
            h += tl.dot(x_tile.to(a_tile.dtype), a_tile, input_precision=DOT_PRECISION)
        # B is [N, r] row-major; this tile is B.T[r0:r0+BLOCK_R, n0:n0+BLOCK_N].
        b_tile = tl.load(b_base + offs_n[None, :] * rank + offs_r[:, None],
                         mask=mask_n[None, :] & mask_r[:, None], other=0.0)
        acc += tl.dot(h, b_tile.to(tl.float32), input_precision=DOT_PRECISION)
    return acc


@triton.jit
def _fused_bucketed(
    x_ptr, a_base, b_base, tokens, mask_m, rank, K, stride_xm, stride_xk, offs_n, mask_n,
    DOT_PRECISION: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr, RANK_BUCKETS: tl.constexpr,
):
    """`_fused_rank_tiles` with the narrowest rank tile (16, 32 or BLOCK_R) covering `rank`."""
    if RANK_BUCKETS and BLOCK_R > 16 and rank <= 16:
        acc = _fused_rank_tiles(x_ptr, a_base, b_base, tokens, mask_m, rank, K, stride_xm,
                                stride_xk, offs_n, mask_n, DOT_PRECISION, BLOCK_M, BLOCK_N,
                                16, BLOCK_K)
    elif RANK_BUCKETS and BLOCK_R > 32 and rank <= 32:
        acc = _fused_rank_tiles(x_ptr, a_base, b_base, tokens, mask_m, rank, K, stride_xm,
                                stride_xk, offs_n, mask_n, DOT_PRECISION, BLOCK_M, BLOCK_N,
                                32, BLOCK_K)
    else:
        acc = _fused_rank_tiles(x_ptr, a_base, b_base, tokens, mask_m, rank, K, stride_xm,
                                stride_xk, offs_n, mask_n, DOT_PRECISION, BLOCK_M, BLOCK_N,
                                BLOCK_R, BLOCK_K)
    return acc


@triton.jit
def _lora_fused_kernel(
    y_ptr, x_ptr, arena_ptr, a_off_ptr, b_off_ptr, ranks_ptr, scales_ptr,
    seg_starts_ptr, seg_lens_ptr, seg_slots_ptr, tile_segs_ptr, tile_m0_ptr,
    mod0, mod1, mod2, start0, start1, start2, size0, size1, size2,
    n_tiles, K, stride_xm, stride_xk, stride_ym, stride_yn, table_stride,
    MAX_RANK: tl.constexpr, DOT_PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr,
    BLOCK_K: tl.constexpr, RANK_BUCKETS: tl.constexpr,
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
    slot = tl.load(seg_slots_ptr + seg).to(tl.int64)
    mod = select3(mod_i, mod0, mod1, mod2)
    rank = tl.minimum(tl.load(ranks_ptr + slot * table_stride + mod), MAX_RANK)
    if rank <= 0:
        return
    a_off = tl.load(a_off_ptr + slot * table_stride + mod)
    b_off = tl.load(b_off_ptr + slot * table_stride + mod)
    scale = tl.load(scales_ptr + slot * table_stride + mod)
    offs_m = tl.load(tile_m0_ptr + tile) + tl.arange(0, BLOCK_M)
    mask_m = offs_m < tl.load(seg_lens_ptr + seg)
    tokens = (tl.load(seg_starts_ptr + seg) + offs_m).to(tl.int64)
    offs_n = n0 + tl.arange(0, BLOCK_N)
    mask_n = offs_n < out_size
    if (a_off % 8 == 0) & (b_off % 8 == 0) & (rank % 8 == 0):
        # Aligned A and B with rows of a multiple of 8 elements (`// 8 * 8` tells the
        # compiler): 16-byte vector loads, as the page packer lays real models out.
        acc = _fused_bucketed(x_ptr, arena_ptr + a_off // 8 * 8, arena_ptr + b_off // 8 * 8,
                              tokens, mask_m, rank // 8 * 8, K, stride_xm, stride_xk, offs_n,
                              mask_n, DOT_PRECISION, BLOCK_M, BLOCK_N, BLOCK_R, BLOCK_K,
                              RANK_BUCKETS)
    else:
        acc = _fused_bucketed(x_ptr, arena_ptr + a_off, arena_ptr + b_off, tokens, mask_m,
                              rank, K, stride_xm, stride_xk, offs_n, mask_n, DOT_PRECISION,
                              BLOCK_M, BLOCK_N, BLOCK_R, BLOCK_K, RANK_BUCKETS)
    o_start = select3(mod_i, start0, start1, start2)
    y_ptrs = y_ptr + tokens[:, None] * stride_ym + (o_start + offs_n)[None, :] * stride_yn
    y_mask = mask_m[:, None] & mask_n[None, :]
    y_old = tl.load(y_ptrs, mask=y_mask, other=0.0)
    tl.store(y_ptrs, (y_old.to(tl.float32) + acc * scale).to(y_ptrs.dtype.element_ty),
             mask=y_mask)


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
    max_rank: int,
    block_n: int = 128,
    block_k: int = 256,
    num_warps: int = 4,
    num_stages: int = 2,
    rank_buckets: bool = True,
) -> None:
    """y += the multi-LoRA delta of x (as `add_lora_reference` defines it) in one launch per
    group of up to three modules. `max_rank` bounds every rank in the tables (no host sync)."""
    check_rows(x, y, meta)
    check_slices(y, module_ids, out_slices)
    check_tables(arena, x, a_offsets, ranks)
    check_tables(arena, y, b_offsets, ranks, float32_x=True)
    check_scales(scales, ranks)
    if meta.num_tiles == 0 or x.shape[0] == 0 or max_rank <= 0:
        return
    block_r = rank_block(max_rank)
    for g in range(0, len(module_ids), MAX_MODULES_PER_LAUNCH):
        mods = tuple(module_ids[g : g + MAX_MODULES_PER_LAUNCH])
        slices = tuple(out_slices[g : g + MAX_MODULES_PER_LAUNCH])
        pad = (0,) * (MAX_MODULES_PER_LAUNCH - len(mods))
        ids, starts = mods + pad, tuple(s for s, _ in slices) + pad
        sizes = tuple(n for _, n in slices) + pad
        n_tiles = triton.cdiv(max(sizes), block_n)
        _lora_fused_kernel[(meta.num_tiles, len(mods) * n_tiles)](
            y, x, arena, a_offsets, b_offsets, ranks, scales,
            meta.seg_starts, meta.seg_lens, meta.seg_slots, meta.tile_segs, meta.tile_m0,
            ids[0], ids[1], ids[2], starts[0], starts[1], starts[2],
            sizes[0], sizes[1], sizes[2], n_tiles, x.shape[1], x.stride(0), x.stride(1),
            y.stride(0), y.stride(1), a_offsets.stride(0),
            MAX_RANK=max_rank, DOT_PRECISION=dot_precision(x.dtype, arena.dtype),
            BLOCK_M=meta.block_m, BLOCK_N=block_n, BLOCK_R=block_r, BLOCK_K=block_k,
            RANK_BUCKETS=rank_buckets, num_warps=num_warps, num_stages=num_stages,
        )

