"""Paged attention for decode steps: one query token per sequence, split along the context.

Semantics (`attention_reference.paged_attention_reference` with one query per sequence): the
query of sequence b is q[query_starts[b]] (sequences with no query are skipped) and attends to
keys 0..seq_lens[b]-1 read through block_tables[b]; query head h reads kv head h // (H / Hkv).

Each program takes one (sequence, kv head, context split): the GQA group's query heads share
every K/V tile it loads (rows of one tl.dot), so K and V are read once per kv head. With more
than one split (flash-decoding), programs write float32 partials (running max, sum, unnormalized
output) and a second kernel merges them.

Shapes: q [T, H, D], out [T, H, D] (unit stride along D); k_cache, v_cache [num_pages,
block_size, Hkv, D] strided arena views; block_tables [B, max_blocks] int32; seq_lens [B]
int32; query_starts [B + 1] int32; partials [B, H, num_splits, 2] and [B, H, num_splits, D].
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

MERGE_SPLITS_PAD = 64  # slora_kernels.paged_attention.MAX_SPLITS


# The split count and the block-table width change from step to step: runtime values that
# Triton must not specialize on, so a new batch shape compiles no new variant mid-serving.
@triton.jit(do_not_specialize=["num_splits", "stride_bt"])
def _decode_split_kernel(
    q_ptr, k_ptr, v_ptr, out_ptr, part_ml_ptr, part_acc_ptr,
    block_tables_ptr, seq_lens_ptr, query_starts_ptr,
    scale_log2, tokens_per_split, num_splits,
    stride_qt, stride_qh, stride_ot, stride_oh,
    stride_kp, stride_kr, stride_kh, stride_vp, stride_vr, stride_vh, stride_bt,
    NUM_HEADS: tl.constexpr, GROUP: tl.constexpr, GROUP_PAD: tl.constexpr,
    HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr,
    SINGLE_SPLIT: tl.constexpr, DOT_PRECISION: tl.constexpr,
):
    b = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    q_row = tl.load(query_starts_ptr + b)
    if tl.load(query_starts_ptr + b + 1) <= q_row:
        return
    ctx_len = tl.load(seq_lens_ptr + b)
    t_lo = split * tokens_per_split
    if t_lo >= ctx_len:
        return
    t_hi = tl.minimum(t_lo + tokens_per_split, ctx_len)

    offs_g = tl.arange(0, GROUP_PAD)
    mask_g = offs_g < GROUP
    heads = kv_head * GROUP + offs_g
    offs_d = tl.arange(0, HEAD_DIM)
    q = tl.load(q_ptr + q_row.to(tl.int64) * stride_qt + heads[:, None] * stride_qh
                + offs_d[None, :], mask=mask_g[:, None], other=0.0)
    m_i = tl.full((GROUP_PAD,), float("-inf"), tl.float32)
    l_i = tl.zeros((GROUP_PAD,), tl.float32)
    acc = tl.zeros((GROUP_PAD, HEAD_DIM), tl.float32)
    table = block_tables_ptr + b.to(tl.int64) * stride_bt
    k_head = k_ptr + kv_head * stride_kh
    v_head = v_ptr + kv_head * stride_vh
    for t0 in range(t_lo, t_hi, BLOCK_N):
        offs_t = t0 + tl.arange(0, BLOCK_N)
        mask_t = offs_t < t_hi
        pages = tl.load(table + offs_t // BLOCK_SIZE, mask=mask_t, other=0).to(tl.int64)
        rows = offs_t % BLOCK_SIZE
        k = tl.load(k_head + pages[:, None] * stride_kp + rows[:, None] * stride_kr
                    + offs_d[None, :], mask=mask_t[:, None], other=0.0)
        s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * scale_log2
        s = tl.where(mask_t[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(v_head + pages[:, None] * stride_vp + rows[:, None] * stride_vr
                    + offs_d[None, :], mask=mask_t[:, None], other=0.0)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
        m_i = m_new

    if SINGLE_SPLIT:
        out = acc / l_i[:, None]
        tl.store(out_ptr + q_row.to(tl.int64) * stride_ot + heads[:, None] * stride_oh
                 + offs_d[None, :], out.to(out_ptr.dtype.element_ty), mask=mask_g[:, None])
    else:
        part = (b * NUM_HEADS + heads).to(tl.int64) * num_splits + split
        tl.store(part_ml_ptr + part * 2, m_i, mask=mask_g)
        tl.store(part_ml_ptr + part * 2 + 1, l_i, mask=mask_g)
        tl.store(part_acc_ptr + part[:, None] * HEAD_DIM + offs_d[None, :], acc,
                 mask=mask_g[:, None])


@triton.jit(do_not_specialize=["num_splits"])
def _decode_merge_kernel(
    out_ptr, part_ml_ptr, part_acc_ptr, seq_lens_ptr, query_starts_ptr,
    tokens_per_split, num_splits, stride_ot, stride_oh,
    NUM_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, SPLITS_PAD: tl.constexpr,
):
    b = tl.program_id(0)
    head = tl.program_id(1)
    q_row = tl.load(query_starts_ptr + b)
    if tl.load(query_starts_ptr + b + 1) <= q_row:
        return
    num_valid = tl.cdiv(tl.load(seq_lens_ptr + b), tokens_per_split)
    offs_s = tl.arange(0, SPLITS_PAD)
    mask_s = offs_s < num_valid
    part = (b * NUM_HEADS + head).to(tl.int64) * num_splits + offs_s
    m = tl.load(part_ml_ptr + part * 2, mask=mask_s, other=float("-inf"))
    l_s = tl.load(part_ml_ptr + part * 2 + 1, mask=mask_s, other=0.0)
    offs_d = tl.arange(0, HEAD_DIM)
    acc = tl.load(part_acc_ptr + part[:, None] * HEAD_DIM + offs_d[None, :],
                  mask=mask_s[:, None], other=0.0)
    w = tl.where(mask_s, tl.exp2(m - tl.max(m, 0)), 0.0)
    out = tl.sum(acc * w[:, None], 0) / tl.sum(l_s * w, 0)
    tl.store(out_ptr + q_row.to(tl.int64) * stride_ot + head * stride_oh + offs_d,
             out.to(out_ptr.dtype.element_ty))


def paged_attention_decode(
    out: torch.Tensor,
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    query_starts: torch.Tensor,
    scale: float,
    *,
    num_splits: int,
    block_n: int,
    num_warps: int = 4,
    num_stages: int = 2,
) -> None:
    """Write decode attention into `out` (see module docstring). Every sequence must have at
    most one query; `num_splits` context splits of equal, block_n-aligned length cover
    block_tables' capacity."""
    num_heads, head_dim = q.shape[1], q.shape[2]
    num_seqs, max_blocks = block_tables.shape
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    group = num_heads // num_kv_heads
    capacity = max_blocks * block_size
    tokens_per_split = triton.cdiv(triton.cdiv(capacity, num_splits), block_n) * block_n
    num_splits = triton.cdiv(capacity, tokens_per_split)
    part_ml = part_acc = out  # unused placeholders when there is a single split
    if num_splits > 1:
        part_ml = torch.empty((num_seqs, num_heads, num_splits, 2), dtype=torch.float32,
                              device=q.device)
        part_acc = torch.empty((num_seqs, num_heads, num_splits, head_dim),
                               dtype=torch.float32, device=q.device)
    _decode_split_kernel[(num_seqs, num_kv_heads, num_splits)](
        q, k_cache, v_cache, out, part_ml, part_acc, block_tables, seq_lens, query_starts,
        scale * 1.4426950408889634, tokens_per_split, num_splits,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2), block_tables.stride(0),
        NUM_HEADS=num_heads, GROUP=group, GROUP_PAD=max(16, triton.next_power_of_2(group)),
        HEAD_DIM=head_dim, BLOCK_SIZE=block_size, BLOCK_N=block_n, SINGLE_SPLIT=num_splits == 1,
        DOT_PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
        num_warps=num_warps, num_stages=num_stages,
    )
    if num_splits > 1:
        _decode_merge_kernel[(num_seqs, num_heads)](
            out, part_ml, part_acc, seq_lens, query_starts, tokens_per_split, num_splits,
            out.stride(0), out.stride(1),
            NUM_HEADS=num_heads, HEAD_DIM=head_dim,
            # One padded width for every split count up to the launcher's usual maximum, so
            # batch shapes do not each compile their own merge.
            SPLITS_PAD=max(MERGE_SPLITS_PAD, triton.next_power_of_2(num_splits)),
        )
