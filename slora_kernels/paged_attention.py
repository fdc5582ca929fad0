"""`paged_attention_triton`: the launcher that picks the decode or the prefill kernel.

Same semantics as `attention_reference.paged_attention_reference` for every step shape. The
decode kernel (context split, GQA heads sharing K/V loads) is used when the caller states
that every sequence has at most one query (`max_query_len=1`, the engine's decode-only steps);
otherwise the general causal prefill kernel runs, which is also correct for decode.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

import torch
import triton

from slora_kernels.paged_attention_decode import paged_attention_decode
from slora_kernels.paged_attention_prefill import paged_attention_prefill


@dataclass(frozen=True)
class AttentionTiles:
    """Block sizes (tokens) and launch shape of the two attention kernels."""

    decode_block_n: int = 64
    decode_num_warps: int = 4
    decode_num_stages: int = 2
    prefill_block_m: int = 64
    prefill_block_n: int = 64
    prefill_num_warps: int = 4
    prefill_num_stages: int = 2


DEFAULT_TILES = AttentionTiles()
# A context split shorter than this gives a program too little to read to pay for the merge.
MIN_TOKENS_PER_SPLIT = 256
MAX_SPLITS = 64
PROGRAMS_PER_SM = 4


@lru_cache(maxsize=16)
def _num_sms(device: torch.device) -> int:
    if device.type != "cuda":
        return 4
    return torch.cuda.get_device_properties(device).multi_processor_count


def pick_num_splits(num_seqs: int, num_kv_heads: int, capacity: int,
                    device: torch.device) -> int:
    """Context splits that give every multiprocessor a few decode programs."""
    want = triton.cdiv(PROGRAMS_PER_SM * _num_sms(device), max(1, num_seqs * num_kv_heads))
    return max(1, min(want, triton.cdiv(capacity, MIN_TOKENS_PER_SPLIT), MAX_SPLITS))


def paged_attention_triton(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    query_starts: torch.Tensor,
    scale: float,
    *,
    max_query_len: int | None = None,
    num_splits: int | None = None,
    tiles: AttentionTiles = DEFAULT_TILES,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Causal attention of each sequence's new queries over its paged context.

    `max_query_len`, when given, must bound every sequence's query count (1 selects the
    decode kernel). `num_splits` overrides the decode kernel's context split count. `out`, if
    given, receives the result (shaped like q) and is returned.
    """
    _check(q, k_cache, v_cache, block_tables, seq_lens, query_starts)
    if out is None:
        out = torch.empty_like(q)
    elif out.shape != q.shape or out.dtype != q.dtype or out.stride(-1) != 1:
        raise ValueError(f"out must be shaped like q {tuple(q.shape)}, dtype {q.dtype}")
    if q.shape[0] == 0 or block_tables.shape[0] == 0:
        return out
    if max_query_len == 1:
        capacity = block_tables.shape[1] * k_cache.shape[1]
        splits = num_splits or pick_num_splits(block_tables.shape[0], k_cache.shape[2],
                                               capacity, q.device)
        paged_attention_decode(out, q, k_cache, v_cache, block_tables, seq_lens, query_starts,
                               scale, num_splits=splits, block_n=tiles.decode_block_n,
                               num_warps=tiles.decode_num_warps,
                               num_stages=tiles.decode_num_stages)
    else:
        paged_attention_prefill(out, q, k_cache, v_cache, block_tables, seq_lens,
                                query_starts, scale, block_m=tiles.prefill_block_m,
                                block_n=tiles.prefill_block_n,
                                num_warps=tiles.prefill_num_warps,
                                num_stages=tiles.prefill_num_stages)
    return out


def _check(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
           block_tables: torch.Tensor, seq_lens: torch.Tensor,
           query_starts: torch.Tensor) -> None:
    if q.dim() != 3 or k_cache.dim() != 4 or k_cache.shape != v_cache.shape:
        raise ValueError(f"q must be [T, H, D] and the caches [pages, block_size, Hkv, D]; got "
                         f"{tuple(q.shape)}, {tuple(k_cache.shape)}, {tuple(v_cache.shape)}")
    num_heads, head_dim = q.shape[1], q.shape[2]
    if k_cache.shape[3] != head_dim or num_heads % k_cache.shape[2]:
        raise ValueError(f"q {tuple(q.shape)} does not fit caches {tuple(k_cache.shape)}")
    if triton.next_power_of_2(head_dim) != head_dim or head_dim < 16:
        raise ValueError(f"head_dim {head_dim} must be a power of two >= 16")
    if any(t.stride(-1) != 1 for t in (q, k_cache, v_cache)):
        raise ValueError("q and the caches need unit stride along head_dim")
    if q.dtype != k_cache.dtype or k_cache.dtype != v_cache.dtype:
        raise ValueError(f"q {q.dtype} and caches {k_cache.dtype}/{v_cache.dtype} differ")
    num_seqs = block_tables.shape[0]
    if (block_tables.dtype != torch.int32 or seq_lens.dtype != torch.int32
            or query_starts.dtype != torch.int32):
        raise ValueError("block_tables, seq_lens and query_starts must be int32")
    if seq_lens.shape != (num_seqs,) or query_starts.shape != (num_seqs + 1,):
        raise ValueError(f"seq_lens {tuple(seq_lens.shape)} and query_starts "
                         f"{tuple(query_starts.shape)} do not match {num_seqs} sequences")
    if block_tables.stride(1) != 1:
        raise ValueError("block_tables needs unit stride along blocks")
