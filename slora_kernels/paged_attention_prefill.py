"""Paged attention for prefill and mixed steps: causal, variable-length, over cached blocks.

Semantics (`attention_reference.paged_attention_reference`): sequence b's queries
q[query_starts[b] : query_starts[b+1]] are the last n_b tokens of its context of length
seq_lens[b]; query j sits at position seq_lens[b] - n_b + j and attends to keys 0..that
position, read through block_tables[b]. Query head h reads kv head h // (H / Hkv).

Each program takes BLOCK_M queries of one sequence and one head (flash attention, online
softmax in float32, exp2). The grid has T // BLOCK_M + B query tiles, enough for any split of
T tokens into B sequences; a program finds its sequence by binary search over query_starts
(tile index of sequence b's first tile = query_starts[b] // BLOCK_M + b) and exits if its tile
lies past the sequence's queries.

Shapes: q, out [T, H, D] (unit stride along D); k_cache, v_cache [num_pages, block_size, Hkv, D];
block_tables [B, max_blocks] int32; seq_lens [B] int32; query_starts [B + 1] int32.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _find_sequence(query_starts_ptr, tile, num_seqs, BLOCK_M: tl.constexpr):
    """The sequence b whose tiles contain `tile`: the last b with starts[b] // BLOCK_M + b <=
    tile."""
    # Both bounds derive from `tile` so they are int32 tensors even when Triton specializes
    # num_seqs == 1 into a constant (loop-carried values need one type).
    lo = tile * 0
    hi = tile * 0 + num_seqs
    while lo < hi:
        mid = (lo + hi) // 2
        first_tile = tl.load(query_starts_ptr + mid) // BLOCK_M + mid
        if first_tile <= tile:
            lo = mid + 1
        else:
            hi = mid
    return lo - 1


# The sequence count and the block-table width change from step to step: not specialized on.
@triton.jit(do_not_specialize=["num_seqs", "stride_bt"])
def _prefill_kernel(
    q_ptr, k_ptr, v_ptr, out_ptr, block_tables_ptr, seq_lens_ptr, query_starts_ptr,
    scale_log2, num_seqs,
    stride_qt, stride_qh, stride_ot, stride_oh,
    stride_kp, stride_kr, stride_kh, stride_vp, stride_vr, stride_vh, stride_bt,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, DOT_PRECISION: tl.constexpr,
):
    tile = tl.program_id(0)
    head = tl.program_id(1)
    b = _find_sequence(query_starts_ptr, tile, num_seqs, BLOCK_M)
    q_start = tl.load(query_starts_ptr + b)
    num_queries = tl.load(query_starts_ptr + b + 1) - q_start
    local = tile - (q_start // BLOCK_M + b)
    if local * BLOCK_M >= num_queries:
        return
    ctx_len = tl.load(seq_lens_ptr + b)
    offs_m = local * BLOCK_M + tl.arange(0, BLOCK_M)
    mask_m = offs_m < num_queries
    q_pos = ctx_len - num_queries + offs_m
    rows_q = (q_start + offs_m).to(tl.int64)
    offs_d = tl.arange(0, HEAD_DIM)
    q = tl.load(q_ptr + rows_q[:, None] * stride_qt + head * stride_qh + offs_d[None, :],
                mask=mask_m[:, None], other=0.0)

    m_i = tl.full((BLOCK_M,), float("-inf"), tl.float32)
    l_i = tl.zeros((BLOCK_M,), tl.float32)
    acc = tl.zeros((BLOCK_M, HEAD_DIM), tl.float32)
    kv_head = head // GROUP
    table = block_tables_ptr + b.to(tl.int64) * stride_bt
    k_head = k_ptr + kv_head * stride_kh
    v_head = v_ptr + kv_head * stride_vh
    # Keys past the tile's last query position are masked for every row: stop there.
    t_end = tl.minimum(ctx_len, ctx_len - num_queries + (local + 1) * BLOCK_M)
    for t0 in range(0, t_end, BLOCK_N):
        offs_t = t0 + tl.arange(0, BLOCK_N)
        mask_t = offs_t < t_end
        pages = tl.load(table + offs_t // BLOCK_SIZE, mask=mask_t, other=0).to(tl.int64)
        rows = offs_t % BLOCK_SIZE
        k = tl.load(k_head + pages[:, None] * stride_kp + rows[:, None] * stride_kr
                    + offs_d[None, :], mask=mask_t[:, None], other=0.0)
        s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * scale_log2
        # Key 0 is visible to every row, so each row's running max is finite after tile one.
        visible = mask_t[None, :] & (offs_t[None, :] <= q_pos[:, None])
        s = tl.where(visible, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(v_head + pages[:, None] * stride_vp + rows[:, None] * stride_vr
                    + offs_d[None, :], mask=mask_t[:, None], other=0.0)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
        m_i = m_new

    out = acc / l_i[:, None]
    tl.store(out_ptr + rows_q[:, None] * stride_ot + head * stride_oh + offs_d[None, :],
             out.to(out_ptr.dtype.element_ty), mask=mask_m[:, None])


def paged_attention_prefill(
    out: torch.Tensor,
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    query_starts: torch.Tensor,
    scale: float,
    *,
    block_m: int,
    block_n: int,
    num_warps: int = 4,
    num_stages: int = 2,
) -> None:
    """Write causal paged attention for every query into `out` (see module docstring)."""
    num_tokens, num_heads, head_dim = q.shape
    num_seqs = block_tables.shape[0]
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    grid = (num_tokens // block_m + num_seqs, num_heads)
    _prefill_kernel[grid](
        q, k_cache, v_cache, out, block_tables, seq_lens, query_starts,
        scale * 1.4426950408889634, num_seqs,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2), block_tables.stride(0),
        GROUP=num_heads // num_kv_heads, HEAD_DIM=head_dim, BLOCK_SIZE=block_size,
        BLOCK_M=block_m, BLOCK_N=block_n,
        DOT_PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
        num_warps=num_warps, num_stages=num_stages,
    )
