"""Paged attention and KV writes against the float64 reference, on a NaN-poisoned arena whose
pages are shuffled and interleaved across layers as in the engine's arena."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch

from slora_kernels.attention_reference import paged_attention_reference, write_kv_reference
from slora_kernels.paged_attention import AttentionTiles, paged_attention_triton
from slora_kernels.write_kv import write_kv_triton
from tests.kernel_tests.helpers import DEVICE, DTYPES, ON_GPU, TOLERANCE, generator, randn, rel_err


@dataclass
class AttentionCase:
    q: torch.Tensor
    k_cache: torch.Tensor
    v_cache: torch.Tensor
    block_tables: torch.Tensor
    seq_lens: torch.Tensor
    query_starts: torch.Tensor


def _arena_kv(num_pages: int, block_size: int, num_kv_heads: int, head_dim: int,
              dtype: torch.dtype, layer: int = 1, num_layers: int = 2
              ) -> tuple[torch.Tensor, torch.Tensor]:
    """One layer's K and V views of a NaN-filled arena laid out as DESIGN section 3 says."""
    page_numel = block_size * num_layers * 2 * num_kv_heads * head_dim
    arena = torch.full((num_pages, page_numel), float("nan"), dtype=dtype, device=DEVICE)
    kv = arena.view(num_pages, num_layers, 2, block_size, num_kv_heads, head_dim)
    return kv[:, layer, 0], kv[:, layer, 1]


def build_case(ctx_and_queries: list[tuple[int, int]], num_heads: int, num_kv_heads: int,
               head_dim: int, block_size: int, dtype: torch.dtype, seed: int) -> AttentionCase:
    """Sequences of (context length, new queries); every context token is written through
    write_kv_reference into pages drawn at random, the rest of the arena stays NaN."""
    gen = generator(seed)
    blocks = [(c + block_size - 1) // block_size for c, _ in ctx_and_queries]
    num_pages = sum(blocks) + 3
    k_cache, v_cache = _arena_kv(num_pages, block_size, num_kv_heads, head_dim, dtype)
    perm = torch.randperm(num_pages, generator=gen).tolist()
    max_blocks = max(blocks) + 2  # trailing table entries point nowhere useful: never read
    tables = torch.full((len(blocks), max_blocks), num_pages - 1, dtype=torch.int32)
    slots: list[int] = []
    for b, (ctx, _) in enumerate(ctx_and_queries):
        mine, perm = perm[: blocks[b]], perm[blocks[b]:]
        tables[b, : blocks[b]] = torch.tensor(mine, dtype=torch.int32)
        slots += [mine[p // block_size] * block_size + p % block_size for p in range(ctx)]
    k = randn(len(slots), num_kv_heads, head_dim, dtype=dtype, gen=gen)
    v = randn(len(slots), num_kv_heads, head_dim, dtype=dtype, gen=gen)
    write_kv_reference(k_cache, v_cache, k, v, torch.tensor(slots, device=DEVICE))
    starts = [0]
    for _, n in ctx_and_queries:
        starts.append(starts[-1] + n)
    return AttentionCase(
        q=randn(starts[-1], num_heads, head_dim, dtype=dtype, gen=gen),
        k_cache=k_cache,
        v_cache=v_cache,
        block_tables=tables.to(DEVICE),
        seq_lens=torch.tensor([c for c, _ in ctx_and_queries], dtype=torch.int32, device=DEVICE),
        query_starts=torch.tensor(starts, dtype=torch.int32, device=DEVICE),
    )


def _check_attention(case: AttentionCase, dtype: torch.dtype, **knobs: object) -> None:
    scale = case.q.shape[2] ** -0.5
    args = (case.block_tables, case.seq_lens, case.query_starts, scale)
    out = torch.full_like(case.q, float("nan"))
    got = paged_attention_triton(case.q, case.k_cache, case.v_cache, *args, out=out, **knobs)  # type: ignore[arg-type]
    assert got is out
    ref = paged_attention_reference(case.q.double(), case.k_cache.double(),
                                    case.v_cache.double(), *args)
    err = rel_err(out, ref)
    assert err < TOLERANCE[dtype], f"relative error {err:.2e}"


SMALL_TILES = AttentionTiles(decode_block_n=16, prefill_block_m=16, prefill_block_n=16)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("num_heads", "num_kv_heads"), [(2, 2), (8, 2)])
@pytest.mark.parametrize("num_splits", [None, 1, 3])
def test_decode(dtype: torch.dtype, num_heads: int, num_kv_heads: int,
                num_splits: int | None) -> None:
    seqs = [(1, 1), (17, 1), (100, 1), (301, 1)]
    case = build_case(seqs, num_heads, num_kv_heads, 32, 16, dtype, seed=1)
    _check_attention(case, dtype, max_query_len=1, num_splits=num_splits, tiles=SMALL_TILES)


@pytest.mark.parametrize("dtype", DTYPES)
def test_decode_gqa_group_over_16_and_small_blocks(dtype: torch.dtype) -> None:
    # 32 query heads per kv head fill more than one 16-row tile; 4-token blocks put several
    # pages into each key tile.
    case = build_case([(70, 1), (5, 1), (33, 1)], 32, 1, 16, 4, dtype, seed=2)
    _check_attention(case, dtype, max_query_len=1, num_splits=2)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("num_kv_heads", [4, 1])
def test_prefill_with_cached_blocks(dtype: torch.dtype, num_kv_heads: int) -> None:
    # Fresh prompts, chunked prefill over cached context, a decode token, an idle sequence.
    seqs = [(5, 5), (40, 17), (130, 1), (33, 0), (64, 64), (90, 37)]
    case = build_case(seqs, 4, num_kv_heads, 32, 16, dtype, seed=3)
    _check_attention(case, dtype, tiles=SMALL_TILES)


def test_prefill_default_tiles_and_single_sequence() -> None:
    case = build_case([(150, 150)], 2, 1, 64, 16, torch.float16, seed=4)
    _check_attention(case, torch.float16)


def test_decode_through_prefill_kernel_when_query_count_unknown() -> None:
    case = build_case([(9, 1), (48, 1), (1, 1)], 4, 2, 32, 8, torch.float32, seed=5)
    _check_attention(case, torch.float32, tiles=SMALL_TILES)


@pytest.mark.parametrize("dtype", DTYPES)
def test_write_kv_matches_reference_and_skips_negative_slots(dtype: torch.dtype) -> None:
    gen = generator(6)
    k_cache, v_cache = _arena_kv(6, 8, 3, 32, dtype)
    k_ref, v_ref = k_cache.clone(), v_cache.clone()
    # Token rows with a stride (a slice of a fused qkv output) and a float32 source.
    qkv = randn(9, 3 * 3, 32, dtype=torch.float32, gen=gen)
    k, v = qkv[:, 3:6], qkv[:, 6:9]
    slots = torch.tensor([5, -1, 0, 47, 8, 9, -1, 23, 31], device=DEVICE)
    write_kv_triton(k_cache, v_cache, k, v, slots)
    write_kv_reference(k_ref, v_ref, k, v, slots)
    assert torch.equal(k_cache.isnan(), k_ref.isnan()) and torch.equal(v_cache.isnan(),
                                                                        v_ref.isnan())
    written = ~k_ref.isnan()
    assert torch.equal(k_cache[written], k_ref[written])
    assert torch.equal(v_cache[written], v_ref[written])


def test_bad_attention_inputs_are_refused() -> None:
    case = build_case([(4, 1)], 2, 2, 32, 4, torch.float32, seed=7)
    with pytest.raises(ValueError, match="int32"):
        paged_attention_triton(case.q, case.k_cache, case.v_cache, case.block_tables.long(),
                               case.seq_lens, case.query_starts, 1.0)
    with pytest.raises(ValueError, match="does not fit"):
        paged_attention_triton(case.q[:, :1], case.k_cache, case.v_cache, case.block_tables,
                               case.seq_lens, case.query_starts, 1.0)


# Full model shapes on the GPU: Llama-2-7B (32 heads, MHA, 16-token blocks) and Llama-3-8B
# (32 query heads over 8 kv heads, 32-token blocks), head_dim 128.
FULL = [("llama2", 32, 32, 16), ("llama3", 32, 8, 32)]


@pytest.mark.skipif(not ON_GPU, reason="full-size shapes need the GPU (TRITON_INTERPRET=0)")
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("name", "heads", "kv_heads", "bs"), FULL, ids=[f[0] for f in FULL])
@pytest.mark.parametrize("step", ["decode", "prefill"])
def test_full_size_on_gpu(dtype: torch.dtype, name: str, heads: int, kv_heads: int, bs: int,
                          step: str) -> None:
    if step == "decode":
        seqs = [(c, 1) for c in (1, 31, 2048, 4097, 700, 8192, 129, 16)]
        case = build_case(seqs, heads, kv_heads, 128, bs, dtype, seed=8)
        _check_attention(case, dtype, max_query_len=1)
    else:
        seqs = [(1024, 1024), (3000, 200), (77, 1), (513, 512), (4096, 64)]
        case = build_case(seqs, heads, kv_heads, 128, bs, dtype, seed=9)
        _check_attention(case, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("tiles", [SMALL_TILES, AttentionTiles()], ids=["small", "default"])
def test_prefill_with_padded_tokens_and_sequences(dtype: torch.dtype,
                                                  tiles: AttentionTiles) -> None:
    """The padded layout mixed-step CUDA graphs use: extra query rows that belong to no
    sequence and extra sequences with zero queries (starts = real token count, table rows 0).
    Real rows equal the unpadded result; nothing else is read or written."""
    case = build_case([(40, 40), (70, 1), (33, 20), (5, 1)], 4, 2, 16, 16, dtype, seed=31)
    scale = case.q.shape[2] ** -0.5
    t_real, b_real = case.q.shape[0], case.seq_lens.shape[0]
    t_pad, b_pad = t_real + 45, b_real + 6
    gen = generator(32)
    q = torch.cat([case.q, randn(t_pad - t_real, 4, 16, dtype=dtype, gen=gen)])
    tables = torch.zeros(b_pad, case.block_tables.shape[1], dtype=torch.int32, device=DEVICE)
    tables[:b_real] = case.block_tables
    seq_lens = torch.ones(b_pad, dtype=torch.int32, device=DEVICE)
    seq_lens[:b_real] = case.seq_lens
    starts = torch.full((b_pad + 1,), t_real, dtype=torch.int32, device=DEVICE)
    starts[: b_real + 1] = case.query_starts
    out = torch.full_like(q, 7.0)
    paged_attention_triton(q, case.k_cache, case.v_cache, tables, seq_lens, starts, scale,
                           max_query_len=t_pad, out=out, tiles=tiles)
    ref = paged_attention_reference(case.q.double(), case.k_cache.double(),
                                    case.v_cache.double(), case.block_tables, case.seq_lens,
                                    case.query_starts, scale)
    assert rel_err(out[:t_real], ref) < TOLERANCE[dtype]
    assert torch.equal(out[t_real:], torch.full_like(out[t_real:], 7.0))
