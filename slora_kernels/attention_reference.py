"""Torch references for paged attention over KV blocks in the page arena.

One call serves prefill, chunked prefill and decode: sequence b has queries
q[query_starts[b]:query_starts[b+1]], which are the last n_b tokens of its context of length
seq_lens[b]. Query j of sequence b sits at position seq_lens[b] - n_b + j and attends (causally)
to keys 0..that position, read through block_tables[b] (key at position p lives in block
block_tables[b, p // block_size], row p % block_size).

Shapes: q [T, H, D]; k_cache, v_cache [num_pages, block_size, Hkv, D] (strided views of the arena,
one layer); block_tables [B, max_blocks] int32; seq_lens [B] int32; query_starts [B + 1] int32;
out [T, H, D]. H must be a multiple of Hkv (GQA: query head h reads kv head h // (H / Hkv)).
"""

from __future__ import annotations

import torch


def write_kv_reference(
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """k_cache[slot // bs, slot % bs] = k[t] for every token t with slot = slot_mapping[t] >= 0."""
    bs = k_cache.shape[1]
    keep = slot_mapping >= 0
    slots = slot_mapping[keep].long()
    pages, rows = slots // bs, slots % bs
    k_cache[pages, rows] = k[keep].to(k_cache.dtype)
    v_cache[pages, rows] = v[keep].to(v_cache.dtype)


def paged_attention_reference(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    query_starts: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """Causal attention of each sequence's new queries over its paged context (float32 math)."""
    out = torch.empty_like(q)
    num_heads, head_dim = q.shape[1], q.shape[2]
    num_kv_heads, bs = k_cache.shape[2], k_cache.shape[1]
    group = num_heads // num_kv_heads
    lens = seq_lens.tolist()
    qs = query_starts.tolist()
    tables = block_tables.tolist()
    for b, ctx_len in enumerate(lens):
        q0, q1 = qs[b], qs[b + 1]
        n = q1 - q0
        if n == 0:
            continue
        nblocks = (ctx_len + bs - 1) // bs
        pages = torch.tensor(tables[b][:nblocks], dtype=torch.long, device=q.device)
        k = k_cache[pages].reshape(-1, num_kv_heads, head_dim)[:ctx_len].float()
        v = v_cache[pages].reshape(-1, num_kv_heads, head_dim)[:ctx_len].float()
        k = k.repeat_interleave(group, dim=1)  # [ctx, H, D]
        v = v.repeat_interleave(group, dim=1)
        qb = q[q0:q1].float()  # [n, H, D]
        scores = torch.einsum("nhd,chd->hnc", qb, k) * scale
        qpos = torch.arange(ctx_len - n, ctx_len, device=q.device)[:, None]
        kpos = torch.arange(ctx_len, device=q.device)[None, :]
        scores = scores.masked_fill(kpos > qpos, float("-inf"))
        probs = scores.softmax(dim=-1)
        out[q0:q1] = torch.einsum("hnc,chd->nhd", probs, v).to(q.dtype)
    return out
