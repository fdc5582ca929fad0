"""Segmented multi-LoRA expand: y[:, slice] += scale * buf @ B.T per segment, B from the arena.

Semantics, for every segment s, every module index i < len(module_ids) with m = module_ids[i],
(o_start, N) = out_slices[i] and r = min(ranks[slot_s, m], max_rank) > 0:

    h = sum_j buf[j, tokens of s, i, :r]                           # the shrink's K splits
    B = arena[b_offsets[slot_s, m] : + N * r].view(N, r)
    y[tokens of s, o_start : o_start + N] += scales[slot_s, m] * h @ B.T   (float32 math)

Tokens of no segment and modules of rank 0 are left untouched, so several launches (one per
group of modules) may target slices of the same y.

Shapes: y [T, N_total] (any strides, updated in place); buf [split_k, T, num_modules, max_rank]
float32; b_offsets [num_slots, num_modules] int64, ranks int32, scales float32 (contiguous).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from slora_kernels.lora_common import (
    MAX_MODULES_PER_LAUNCH,
    check_buf,
    check_scales,
    check_slices,
    check_tables,
    dot_precision,
    pdl_options,
    segment_rows,
    select3,
    tile_entry,
    wait_for_producer,
)
from slora_kernels.lora_meta import LoraMeta


@triton.jit
def _split_sum(buf_rows, h_mask, offs_r, stride_bs, split_k, BLOCK_M: tl.constexpr,
               BLOCK_R: tl.constexpr, USE_PDL: tl.constexpr):
    """The shrink's K splits of these rows summed (float32 [BLOCK_M, BLOCK_R]), after it."""
    h = tl.zeros((BLOCK_M, BLOCK_R), dtype=tl.float32)
    wait_for_producer(USE_PDL)
    for j in range(split_k):
        h += tl.load(buf_rows[:, None] + j * stride_bs + offs_r[None, :], mask=h_mask,
                     other=0.0)
    return h


@triton.jit
def _expand_rank_tiles(
    y_ptrs, y_mask, buf_rows, b_base, rank, scale, offs_n, mask_n, mask_m, stride_bs, split_k,
    DOT_PRECISION: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr, EARLY_LOADS: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    """y[rows, cols] += scale * (sum of buf's K splits)[:, :rank] @ B[cols, :rank].T. With
    EARLY_LOADS the y tile and each B tile are loaded before the K splits are summed, so their
    latency overlaps the sum's (as the row kernels do, lora_rows._rows_expand_tiles). With
    USE_PDL only the sum waits for the shrink (launched as its programmatic dependent, this may
    start while the shrink runs). B is widened to float32 for the dot (tf32 on 16-bit arenas):
    a 16-bit dot lost at rank 64 on the H200 (lora-grid-dot16-rejected-h200.json)."""
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    if EARLY_LOADS:
        y_old = tl.load(y_ptrs, mask=y_mask, other=0.0)
    for r0 in range(0, rank, BLOCK_R):
        offs_r = r0 + tl.arange(0, BLOCK_R)
        mask_r = offs_r < rank
        h_mask = mask_m[:, None] & mask_r[None, :]
        # B is [N, r] row-major; this tile is B.T[r0:r0+BLOCK_R, n0:n0+BLOCK_N].
        b_ptrs = b_base + offs_n[None, :] * rank + offs_r[:, None]
        b_mask = mask_n[None, :] & mask_r[:, None]
        if EARLY_LOADS:
            b_tile = tl.load(b_ptrs, mask=b_mask, other=0.0)
        h = _split_sum(buf_rows, h_mask, offs_r, stride_bs, split_k, BLOCK_M, BLOCK_R,
                       USE_PDL)
        if not EARLY_LOADS:
            b_tile = tl.load(b_ptrs, mask=b_mask, other=0.0)
        acc += tl.dot(h, b_tile.to(tl.float32), input_precision=DOT_PRECISION)
    if not EARLY_LOADS:
        y_old = tl.load(y_ptrs, mask=y_mask, other=0.0)
    tl.store(y_ptrs, (y_old.to(tl.float32) + acc * scale).to(y_ptrs.dtype.element_ty),
             mask=y_mask)


@triton.jit
def _expand_bucketed(
    y_ptrs, y_mask, buf_rows, b_base, rank, scale, offs_n, mask_n, mask_m, stride_bs, split_k,
    DOT_PRECISION: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_R: tl.constexpr, RANK_BUCKETS: tl.constexpr, EARLY_LOADS: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    """`_expand_rank_tiles` with the narrowest rank tile (16, 32 or BLOCK_R) covering `rank`."""
    if RANK_BUCKETS and BLOCK_R > 16 and rank <= 16:
        _expand_rank_tiles(y_ptrs, y_mask, buf_rows, b_base, rank, scale, offs_n, mask_n,
                           mask_m, stride_bs, split_k, DOT_PRECISION, BLOCK_M, BLOCK_N, 16,
                           EARLY_LOADS, USE_PDL)
    elif RANK_BUCKETS and BLOCK_R > 32 and rank <= 32:
        _expand_rank_tiles(y_ptrs, y_mask, buf_rows, b_base, rank, scale, offs_n, mask_n,
                           mask_m, stride_bs, split_k, DOT_PRECISION, BLOCK_M, BLOCK_N, 32,
                           EARLY_LOADS, USE_PDL)
    else:
        _expand_rank_tiles(y_ptrs, y_mask, buf_rows, b_base, rank, scale, offs_n, mask_n,
                           mask_m, stride_bs, split_k, DOT_PRECISION, BLOCK_M, BLOCK_N, BLOCK_R,
                           EARLY_LOADS, USE_PDL)


@triton.jit
def _expand_col(y_rows, mask_m, h, b_base, rank, scale, offs_r, mask_r, n_lo, out_size,
                stride_yn, DOT_PRECISION: tl.constexpr, BLOCK_N: tl.constexpr):
    """y[rows, n_lo : n_lo + BLOCK_N] += scale * h @ B.T, loaded, multiplied and stored."""
    offs_n = n_lo + tl.arange(0, BLOCK_N)
    mask_n = offs_n < out_size
    b_tile = tl.load(b_base + offs_n[None, :] * rank + offs_r[:, None],
                     mask=mask_n[None, :] & mask_r[:, None], other=0.0)
    y_ptrs = y_rows[:, None] + offs_n[None, :] * stride_yn
    y_mask = mask_m[:, None] & mask_n[None, :]
    y_old = tl.load(y_ptrs, mask=y_mask, other=0.0)
    acc = tl.dot(h, b_tile.to(tl.float32), input_precision=DOT_PRECISION)
    tl.store(y_ptrs, (y_old.to(tl.float32) + acc * scale).to(y_ptrs.dtype.element_ty),
             mask=y_mask)


@triton.jit
def _expand_cols(
    y_rows, mask_m, buf_rows, b_base, rank, scale, n0, out_size, stride_yn, stride_bs,
    split_k, DOT_PRECISION: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_R: tl.constexpr, COLS: tl.constexpr, USE_PDL: tl.constexpr,
):
    """y[rows, n0 : n0 + COLS * BLOCK_N] += scale * h @ B.T for a rank of at most BLOCK_R,
    COLS column tiles in turn, the K splits summed once for all of them; each tile's B and y
    are loaded while the one before is multiplied, by the compiler's two-stage pipeline
    (asynchronous copies through shared memory). Held in registers by hand instead (the
    first tile's before the sum), they took 216-255 registers a thread and lost
    (lora-distinct-layer-regs-51483c3-h100.json)."""
    offs_r = tl.arange(0, BLOCK_R)
    mask_r = offs_r < rank
    h = _split_sum(buf_rows, mask_m[:, None] & mask_r[None, :], offs_r, stride_bs, split_k,
                   BLOCK_M, BLOCK_R, USE_PDL)
    for c in tl.range(0, COLS, num_stages=2):
        _expand_col(y_rows, mask_m, h, b_base, rank, scale, offs_r, mask_r,
                    n0 + c * BLOCK_N, out_size, stride_yn, DOT_PRECISION, BLOCK_N)


@triton.jit
def _expand_cols_bucketed(
    y_rows, mask_m, buf_rows, b_base, rank, scale, n0, out_size, stride_yn, stride_bs,
    split_k, DOT_PRECISION: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_R: tl.constexpr, RANK_BUCKETS: tl.constexpr, COLS: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    """`_expand_cols` at the narrowest rank tile (16, 32 or BLOCK_R) covering `rank`; a rank
    above BLOCK_R (a rank bound over 64) runs `_expand_rank_tiles` a column tile at a time."""
    if RANK_BUCKETS and BLOCK_R > 16 and rank <= 16:
        _expand_cols(y_rows, mask_m, buf_rows, b_base, rank, scale, n0, out_size, stride_yn,
                     stride_bs, split_k, DOT_PRECISION, BLOCK_M, BLOCK_N, 16, COLS, USE_PDL)
    elif RANK_BUCKETS and BLOCK_R > 32 and rank <= 32:
        _expand_cols(y_rows, mask_m, buf_rows, b_base, rank, scale, n0, out_size, stride_yn,
                     stride_bs, split_k, DOT_PRECISION, BLOCK_M, BLOCK_N, 32, COLS, USE_PDL)
    elif rank <= BLOCK_R:
        _expand_cols(y_rows, mask_m, buf_rows, b_base, rank, scale, n0, out_size, stride_yn,
                     stride_bs, split_k, DOT_PRECISION, BLOCK_M, BLOCK_N, BLOCK_R, COLS,
                     USE_PDL)
    else:
        for c in tl.static_range(COLS):
            offs_n = n0 + c * BLOCK_N + tl.arange(0, BLOCK_N)
            mask_n = offs_n < out_size
            _expand_rank_tiles(y_rows[:, None] + offs_n[None, :] * stride_yn,
                               mask_m[:, None] & mask_n[None, :], buf_rows, b_base, rank,
                               scale, offs_n, mask_n, mask_m, stride_bs, split_k,
                               DOT_PRECISION, BLOCK_M, BLOCK_N, BLOCK_R, False, USE_PDL)


# split_k and stride_bs change with the step's shape: runtime values, never specialized on, so
# a new batch shape compiles no new variant.
@triton.jit(do_not_specialize=["split_k", "stride_bs"])
def _lora_expand_kernel(
    y_ptr, buf_ptr, arena_ptr, b_off_ptr, ranks_ptr, scales_ptr,
    seg_starts_ptr, seg_lens_ptr, seg_slots_ptr, tile_segs_ptr, tile_m0_ptr, rows_ptr,
    mod0, mod1, mod2, start0, start1, start2, size0, size1, size2,
    n_tiles, stride_ym, stride_yn, table_stride, split_k,
    stride_bs, stride_bt, stride_bm,
    MAX_RANK: tl.constexpr, DOT_PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr,
    RANK_BUCKETS: tl.constexpr, GATHER_ROWS: tl.constexpr, EARLY_LOADS: tl.constexpr,
    USE_PDL: tl.constexpr, COLS: tl.constexpr,
):
    """A program a (tile entry, module and group of COLS column tiles; `n_tiles` counts the
    groups); an unused entry, a rank-0 module or a group past the module's outputs does
    nothing."""
    tile = tl.program_id(0)
    mod_i = tl.program_id(1) // n_tiles
    n0 = (tl.program_id(1) % n_tiles) * (BLOCK_N * COLS)
    out_size = select3(mod_i, size0, size1, size2)
    if n0 >= out_size:  # past this module's outputs
        return
    seg, slot, mod, rank, real = tile_entry(tile, mod_i, tile_segs_ptr, seg_slots_ptr,
                                            ranks_ptr, mod0, mod1, mod2, table_stride,
                                            MAX_RANK)
    if real & (rank > 0):
        m0 = tl.load(tile_m0_ptr + tile)
        seg_len = tl.load(seg_lens_ptr + seg)
        start = tl.load(seg_starts_ptr + seg)
        b_off = tl.load(b_off_ptr + slot * table_stride + mod)
        scale = tl.load(scales_ptr + slot * table_stride + mod)
        offs_m = m0 + tl.arange(0, BLOCK_M)
        mask_m = offs_m < seg_len
        tokens = segment_rows(rows_ptr, start + offs_m, mask_m, GATHER_ROWS)
        offs_n = n0 + tl.arange(0, BLOCK_N)
        mask_n = offs_n < out_size
        buf_rows = buf_ptr + tokens * stride_bt + mod_i * stride_bm
        o_start = select3(mod_i, start0, start1, start2)
        y_ptrs = y_ptr + tokens[:, None] * stride_ym + (o_start + offs_n)[None, :] * stride_yn
        y_mask = mask_m[:, None] & mask_n[None, :]
        if COLS > 1:
            y_rows = y_ptr + tokens * stride_ym + o_start * stride_yn
            if (b_off % 8 == 0) & (rank % 8 == 0):
                _expand_cols_bucketed(y_rows, mask_m, buf_rows, arena_ptr + b_off // 8 * 8,
                                      rank // 8 * 8, scale, n0, out_size, stride_yn,
                                      stride_bs, split_k, DOT_PRECISION, BLOCK_M, BLOCK_N,
                                      BLOCK_R, RANK_BUCKETS, COLS, USE_PDL)
            else:
                _expand_cols_bucketed(y_rows, mask_m, buf_rows, arena_ptr + b_off, rank, scale,
                                      n0, out_size, stride_yn, stride_bs, split_k,
                                      DOT_PRECISION, BLOCK_M, BLOCK_N, BLOCK_R, RANK_BUCKETS,
                                      COLS, USE_PDL)
        elif (b_off % 8 == 0) & (rank % 8 == 0):
            # Aligned B with rows of a multiple of 8 elements (`// 8 * 8` tells the
            # compiler): every B row segment loads as 16-byte vectors.
            _expand_bucketed(y_ptrs, y_mask, buf_rows, arena_ptr + b_off // 8 * 8,
                             rank // 8 * 8, scale, offs_n, mask_n, mask_m, stride_bs, split_k,
                             DOT_PRECISION, BLOCK_M, BLOCK_N, BLOCK_R, RANK_BUCKETS,
                             EARLY_LOADS, USE_PDL)
        else:
            _expand_bucketed(y_ptrs, y_mask, buf_rows, arena_ptr + b_off, rank,
                             scale, offs_n, mask_n, mask_m, stride_bs, split_k,
                             DOT_PRECISION, BLOCK_M, BLOCK_N, BLOCK_R, RANK_BUCKETS,
                             EARLY_LOADS, USE_PDL)


def lora_expand(
    y: torch.Tensor,
    buf: torch.Tensor,
    arena: torch.Tensor,
    b_offsets: torch.Tensor,
    ranks: torch.Tensor,
    scales: torch.Tensor,
    module_ids: tuple[int, ...],
    out_slices: tuple[tuple[int, int], ...],
    meta: LoraMeta,
    *,
    block_m: int,
    block_n: int,
    block_r: int,
    num_warps: int = 4,
    num_stages: int = 2,
    rank_buckets: bool = True,
    early_loads: bool = False,
    pdl: bool = False,
    cols: int = 1,
) -> None:
    """Add the expand of `buf` into y's column slices (see module docstring). `early_loads`:
    the y and B tiles loaded before the K splits are summed; `pdl` (where `pdl_supported`):
    launched as a programmatic dependent of the shrink before it, which must write nothing
    else this reads (slora_kernels.lora.LoraTiles.pdl). `cols`: column tiles a program
    (LoraTiles.expand_cols)."""
    split_k, num_tokens, num_mods, max_rank = buf.shape
    _check_expand_inputs(y, buf, arena, b_offsets, ranks, scales, module_ids, out_slices)
    if cols < 1:
        raise ValueError(f"cols must be at least 1, got {cols}")
    if meta.num_tiles == 0 or num_tokens == 0:
        return
    max_n = max(size for _, size in out_slices)
    n_tiles = triton.cdiv(max_n, block_n * cols)
    pad = (0,) * (MAX_MODULES_PER_LAUNCH - num_mods)
    mods = tuple(module_ids) + pad
    starts = tuple(s for s, _ in out_slices) + pad
    sizes = tuple(n for _, n in out_slices) + pad
    if block_m != meta.block_m:
        raise ValueError(f"block_m {block_m} but the tile list was built for {meta.block_m}")
    _lora_expand_kernel[(meta.num_tiles, num_mods * n_tiles)](
        y, buf, arena, b_offsets, ranks, scales,
        meta.seg_starts, meta.seg_lens, meta.seg_slots, meta.tile_segs, meta.tile_m0,
        meta.rows_or_slots(), mods[0], mods[1], mods[2], starts[0], starts[1], starts[2],
        sizes[0], sizes[1], sizes[2],
        n_tiles, y.stride(0), y.stride(1), b_offsets.stride(0), split_k,
        buf.stride(0), buf.stride(1), buf.stride(2),
        MAX_RANK=max_rank, DOT_PRECISION=dot_precision(arena.dtype),
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_R=block_r, RANK_BUCKETS=rank_buckets,
        GATHER_ROWS=meta.token_rows is not None, EARLY_LOADS=early_loads, USE_PDL=pdl,
        COLS=cols,
        num_warps=num_warps,
        num_stages=num_stages,
        **pdl_options(pdl),
    )


def _check_expand_inputs(
    y: torch.Tensor,
    buf: torch.Tensor,
    arena: torch.Tensor,
    b_offsets: torch.Tensor,
    ranks: torch.Tensor,
    scales: torch.Tensor,
    module_ids: tuple[int, ...],
    out_slices: tuple[tuple[int, int], ...],
) -> None:
    check_buf(buf, y.shape[0], len(module_ids), f"y {tuple(y.shape)}")
    if len(module_ids) > MAX_MODULES_PER_LAUNCH:
        raise ValueError(f"1..{MAX_MODULES_PER_LAUNCH} modules per launch, got {module_ids}")
    check_slices(y, module_ids, out_slices)
    check_tables(arena, y, b_offsets, ranks)
    check_scales(scales, ranks)
