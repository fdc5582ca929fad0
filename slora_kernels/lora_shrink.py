"""Segmented multi-LoRA shrink: buf = x @ A.T per adapter segment, A read from the page arena.

Semantics, for every segment s, every module index i < len(module_ids) with m = module_ids[i]
and r = min(ranks[slot_s, m], max_rank) > 0, and every split j < split_k:

    A = arena[a_offsets[slot_s, m] : + r * K].view(r, K)
    buf[j, tokens of s, i, :r] = x[tokens of s, K-chunk j] @ A[:, K-chunk j].T     (float32)

so that sum_j buf[j, t, i, :r] = x[t] @ A.T. Entries with ranks >= r, tokens of no segment and
modules of rank 0 are not written. Splitting K across programs keeps the chip busy when a
decode step has few segments; the partial sums are added by the expand kernel, so no atomics
and no zero-fill are needed. Each segment runs the narrowest rank tile (16, 32, BLOCK_R)
that covers its rank, so rank-8 adapters do not pay for a launch bounded at rank 64.

Shapes: x [T, K] (any strides); arena 1-D; a_offsets [num_slots, num_modules] int64, ranks the
same shape int32 (both contiguous); buf [split_k, T, len(module_ids), max_rank] float32.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from slora_kernels.lora_common import (
    MAX_MODULES_PER_LAUNCH,
    check_buf,
    check_tables,
    dot_precision,
    release_dependents,
    segment_rows,
    tile_entry,
)
from slora_kernels.lora_meta import LoraMeta


@triton.jit
def _shrink_rank_tiles(
    x_ptr, a_base, buf_rows, tokens, mask_m, rank, k_lo, k_hi, K, stride_xm, stride_xk,
    DOT_PRECISION: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_R: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    """buf_rows[:, :rank] = x[tokens, k_lo:k_hi] @ A[:rank, k_lo:k_hi].T, rank tile by tile."""
    for r0 in range(0, rank, BLOCK_R):
        offs_r = r0 + tl.arange(0, BLOCK_R)
        mask_r = offs_r < rank
        acc = tl.zeros((BLOCK_M, BLOCK_R), dtype=tl.float32)
        for k0 in range(k_lo, k_hi, BLOCK_K):
            offs_k = k0 + tl.arange(0, BLOCK_K)
            mask_k = offs_k < k_hi
            x_tile = tl.load(
                x_ptr + tokens[:, None] * stride_xm + offs_k[None, :] * stride_xk,
                mask=mask_m[:, None] & mask_k[None, :], other=0.0,
            )
            # A is [r, K] row-major; this tile is A.T[k0:k0+BLOCK_K, r0:r0+BLOCK_R].
            a_tile = tl.load(
                a_base + offs_r[None, :] * K + offs_k[:, None],
                mask=mask_r[None, :] & mask_k[:, None], other=0.0,
            )
            acc += tl.dot(x_tile, a_tile, input_precision=DOT_PRECISION)
        tl.store(buf_rows[:, None] + offs_r[None, :], acc, mask=mask_m[:, None] & mask_r[None, :])


@triton.jit
def _shrink_bucketed(
    x_ptr, a_base, buf_rows, tokens, mask_m, rank, k_lo, k_hi, K, stride_xm, stride_xk,
    DOT_PRECISION: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_R: tl.constexpr,
    BLOCK_K: tl.constexpr, RANK_BUCKETS: tl.constexpr,
):
    """`_shrink_rank_tiles` with the narrowest rank tile (16, 32 or BLOCK_R) that covers this
    segment's rank, so a rank-8 adapter does not pay for the launch's 64-wide tile."""
    if RANK_BUCKETS and BLOCK_R > 16 and rank <= 16:
        _shrink_rank_tiles(x_ptr, a_base, buf_rows, tokens, mask_m, rank, k_lo, k_hi, K,
                           stride_xm, stride_xk, DOT_PRECISION, BLOCK_M, 16, BLOCK_K)
    elif RANK_BUCKETS and BLOCK_R > 32 and rank <= 32:
        _shrink_rank_tiles(x_ptr, a_base, buf_rows, tokens, mask_m, rank, k_lo, k_hi, K,
                           stride_xm, stride_xk, DOT_PRECISION, BLOCK_M, 32, BLOCK_K)
    else:
        _shrink_rank_tiles(x_ptr, a_base, buf_rows, tokens, mask_m, rank, k_lo, k_hi, K,
                           stride_xm, stride_xk, DOT_PRECISION, BLOCK_M, BLOCK_R, BLOCK_K)


@triton.jit
def _shrink_item(
    x_ptr, arena_ptr, buf_ptr, a_off_ptr, ranks_ptr,
    seg_starts_ptr, seg_lens_ptr, seg_slots_ptr, tile_segs_ptr, tile_m0_ptr, rows_ptr,
    tile, mod_i, split, mod0, mod1, mod2, K, k_chunk, stride_xm, stride_xk, table_stride,
    stride_bs, stride_bt, stride_bm,
    MAX_RANK: tl.constexpr, DOT_PRECISION: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr, RANK_BUCKETS: tl.constexpr,
    GATHER_ROWS: tl.constexpr,
):
    """One work item: K-chunk `split` of module `mod_i` for the rows of tile `tile`."""
    seg, slot, mod, rank, real = tile_entry(tile, mod_i, tile_segs_ptr, seg_slots_ptr,
                                            ranks_ptr, mod0, mod1, mod2, table_stride,
                                            MAX_RANK)
    if real & (rank > 0):
        a_off = tl.load(a_off_ptr + slot * table_stride + mod)
        offs_m = tl.load(tile_m0_ptr + tile) + tl.arange(0, BLOCK_M)
        mask_m = offs_m < tl.load(seg_lens_ptr + seg)
        tokens = segment_rows(rows_ptr, tl.load(seg_starts_ptr + seg) + offs_m, mask_m,
                              GATHER_ROWS)
        k_lo = split * k_chunk
        k_hi = tl.minimum(k_lo + k_chunk, K)
        buf_rows = buf_ptr + split * stride_bs + tokens * stride_bt + mod_i * stride_bm
        if a_off % 8 == 0:
            # The page packer puts matrices at multiples of 8 elements whenever the model's
            # sizes are; `// 8 * 8` shows the compiler that alignment: 16-byte A loads.
            _shrink_bucketed(x_ptr, arena_ptr + a_off // 8 * 8, buf_rows, tokens, mask_m, rank,
                             k_lo, k_hi, K, stride_xm, stride_xk,
                             DOT_PRECISION, BLOCK_M, BLOCK_R, BLOCK_K, RANK_BUCKETS)
        else:
            _shrink_bucketed(x_ptr, arena_ptr + a_off, buf_rows, tokens, mask_m, rank,
                             k_lo, k_hi, K, stride_xm, stride_xk,
                             DOT_PRECISION, BLOCK_M, BLOCK_R, BLOCK_K, RANK_BUCKETS)


# Values that change from step to step are runtime arguments that Triton must not specialize
# (on == 1 or % 16), so a new batch shape never compiles a new kernel variant mid-serving.
@triton.jit(do_not_specialize=["num_tiles", "num_mods", "split_k", "stride_bs"])
def _lora_shrink_kernel(
    x_ptr, arena_ptr, buf_ptr, a_off_ptr, ranks_ptr,
    seg_starts_ptr, seg_lens_ptr, seg_slots_ptr, tile_segs_ptr, tile_m0_ptr, rows_ptr,
    mod0, mod1, mod2, num_tiles, num_mods, split_k,
    K, stride_xm, stride_xk, table_stride, stride_bs, stride_bt, stride_bm,
    MAX_RANK: tl.constexpr, DOT_PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr,
    RANK_BUCKETS: tl.constexpr, GATHER_ROWS: tl.constexpr, LAUNCH_DEPENDENTS: tl.constexpr,
):
    release_dependents(LAUNCH_DEPENDENTS)
    # Work items (tile, module, K split), the splits of one tile adjacent so they share its
    # rows of x in the L2.
    k_chunk = tl.cdiv(tl.cdiv(K, BLOCK_K), split_k) * BLOCK_K
    items = num_tiles * num_mods * split_k
    for v in range(tl.program_id(0), items, tl.num_programs(0)):
        _shrink_item(x_ptr, arena_ptr, buf_ptr, a_off_ptr, ranks_ptr,
                     seg_starts_ptr, seg_lens_ptr, seg_slots_ptr, tile_segs_ptr, tile_m0_ptr,
                     rows_ptr, v // split_k // num_mods, v // split_k % num_mods, v % split_k,
                     mod0, mod1, mod2, K, k_chunk, stride_xm, stride_xk,
                     table_stride, stride_bs, stride_bt, stride_bm,
                     MAX_RANK, DOT_PRECISION, BLOCK_M, BLOCK_R, BLOCK_K, RANK_BUCKETS,
                     GATHER_ROWS)


def lora_shrink(
    buf: torch.Tensor,
    x: torch.Tensor,
    arena: torch.Tensor,
    a_offsets: torch.Tensor,
    ranks: torch.Tensor,
    module_ids: tuple[int, ...],
    meta: LoraMeta,
    *,
    block_m: int,
    block_r: int,
    block_k: int,
    num_warps: int = 4,
    num_stages: int = 2,
    rank_buckets: bool = True,
    launch_dependents: bool = False,
) -> None:
    """Write the shrink partial sums into `buf` (see module docstring). `buf.shape[0]` is the
    K split count and `buf.shape[3]` the rank bound; ranks above it are clipped to it.
    `launch_dependents`: let an expand launched with `pdl` start while this runs."""
    split_k, num_tokens, num_mods, max_rank = buf.shape
    _check_shrink_inputs(buf, x, arena, a_offsets, ranks, module_ids)
    if meta.num_tiles == 0 or num_tokens == 0:
        return
    mods = tuple(module_ids) + (0,) * (MAX_MODULES_PER_LAUNCH - num_mods)
    if block_m != meta.block_m:
        raise ValueError(f"block_m {block_m} but the tile list was built for {meta.block_m}")
    _lora_shrink_kernel[(meta.num_tiles * num_mods * split_k,)](
        x, arena, buf, a_offsets, ranks,
        meta.seg_starts, meta.seg_lens, meta.seg_slots, meta.tile_segs, meta.tile_m0,
        meta.rows_or_slots(), mods[0], mods[1], mods[2], meta.num_tiles, num_mods, split_k,
        x.shape[1], x.stride(0), x.stride(1), a_offsets.stride(0),
        buf.stride(0), buf.stride(1), buf.stride(2),
        MAX_RANK=max_rank, DOT_PRECISION=dot_precision(x.dtype),
        BLOCK_M=block_m, BLOCK_R=block_r, BLOCK_K=block_k, RANK_BUCKETS=rank_buckets,
        GATHER_ROWS=meta.token_rows is not None, LAUNCH_DEPENDENTS=launch_dependents, num_warps=num_warps,
        num_stages=num_stages,
    )


def _check_shrink_inputs(
    buf: torch.Tensor,
    x: torch.Tensor,
    arena: torch.Tensor,
    a_offsets: torch.Tensor,
    ranks: torch.Tensor,
    module_ids: tuple[int, ...],
) -> None:
    check_buf(buf, x.shape[0], len(module_ids), f"x {tuple(x.shape)}")
    if not 1 <= len(module_ids) <= MAX_MODULES_PER_LAUNCH:
        raise ValueError(f"1..{MAX_MODULES_PER_LAUNCH} modules per launch, got {module_ids}")
    check_tables(arena, x, a_offsets, ranks)

