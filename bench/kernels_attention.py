"""Paged attention benchmark cases: ours beside the bytes floor and torch SDPA on KV gathered
out of the pages, over an arena laid out as the engine's (layers interleaved in each page)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from functools import partial

import torch
import torch.nn.functional as F
from torch.nn.attention.bias import causal_lower_right

from bench.kernels_timing import DEVICE, graph_time_us, rotation_count
from slora_kernels.paged_attention import DEFAULT_TILES, AttentionTiles, paged_attention_triton

HEAD_DIM = 128
DTYPE = torch.float16
MAX_LAYERS = 16
# name -> (query heads, kv heads, block size): Llama-2-7B and Llama-3-8B.
MODELS = {"llama2-7b": (32, 32, 16), "llama3-8b": (32, 8, 32)}


@dataclass
class PagedKV:
    """An arena of `layers` layers holding every sequence's context in shuffled pages."""

    k: list[torch.Tensor]  # per layer [num_pages, bs, Hkv, D] views
    v: list[torch.Tensor]
    tables: torch.Tensor  # [B, blocks] int32
    seq_lens: torch.Tensor
    query_starts: torch.Tensor
    kv_bytes: int  # one layer's K and V bytes over all contexts


def build_kv(model: str, ctx_and_queries: list[tuple[int, int]]) -> PagedKV:
    _, hkv, bs = MODELS[model]
    kv_bytes = sum(c for c, _ in ctx_and_queries) * hkv * HEAD_DIM * 2 * 2
    layers = min(MAX_LAYERS, rotation_count(kv_bytes))
    blocks = max(-(-c // bs) for c, _ in ctx_and_queries)
    num_seqs = len(ctx_and_queries)
    num_pages = num_seqs * blocks
    page_numel = bs * layers * 2 * hkv * HEAD_DIM
    arena = torch.empty(num_pages, page_numel, dtype=DTYPE, device=DEVICE).normal_()
    view = arena.view(num_pages, layers, 2, bs, hkv, HEAD_DIM)
    tables = torch.randperm(num_pages, device=DEVICE).view(num_seqs, blocks).int()
    starts = [0]
    for _, n in ctx_and_queries:
        starts.append(starts[-1] + n)
    return PagedKV(
        k=[view[:, i, 0] for i in range(layers)],
        v=[view[:, i, 1] for i in range(layers)],
        tables=tables,
        seq_lens=torch.tensor([c for c, _ in ctx_and_queries], dtype=torch.int32, device=DEVICE),
        query_starts=torch.tensor(starts, dtype=torch.int32, device=DEVICE),
        kv_bytes=kv_bytes,
    )


def _ours(kv: PagedKV, layer: int, q: torch.Tensor, out: torch.Tensor, mql: int | None,
          tiles: AttentionTiles) -> Callable[[], object]:
    return lambda: paged_attention_triton(
        q, kv.k[layer], kv.v[layer], kv.tables, kv.seq_lens, kv.query_starts,
        HEAD_DIM**-0.5, max_query_len=mql, tiles=tiles, out=out)


def _gather(kv: PagedKV, layer: int, ctx: int) -> tuple[torch.Tensor, torch.Tensor]:
    """[B, Hkv, ctx, D] K and V of equal-length contexts, gathered out of the pages."""
    num_seqs = kv.tables.shape[0]
    pages = kv.tables.long()
    k = kv.k[layer][pages].view(num_seqs, -1, *kv.k[layer].shape[2:])[:, :ctx]
    v = kv.v[layer][pages].view(num_seqs, -1, *kv.v[layer].shape[2:])[:, :ctx]
    return k.transpose(1, 2), v.transpose(1, 2)


def _sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal_mask: object) -> torch.Tensor:
    gqa = q.shape[1] != k.shape[1]
    if causal_mask is True:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=gqa)
    mask = causal_mask if isinstance(causal_mask, torch.Tensor) else None
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=gqa)


def decode_case(model: str, batch: int, ctx: int, copy_gbs: float,
                tiles: AttentionTiles = DEFAULT_TILES,
                with_baselines: bool = True) -> dict[str, object]:
    heads, hkv, _ = MODELS[model]
    kv = build_kv(model, [(ctx, 1)] * batch)
    layers = len(kv.k)
    qs = [torch.randn(batch, heads, HEAD_DIM, dtype=DTYPE, device=DEVICE) for _ in range(layers)]
    outs = [torch.empty_like(q) for q in qs]
    nbytes = kv.kv_bytes + 2 * qs[0].numel() * 2
    row: dict[str, object] = {"model": model, "batch": batch, "context": ctx,
                              "rotation": layers}
    row["ours_us"] = graph_time_us([_ours(kv, i, qs[i], outs[i], 1, tiles)
                                    for i in range(layers)])
    row["floor_us"] = nbytes / (copy_gbs * 1e3)
    row["bandwidth_gbs"] = nbytes / (row["ours_us"] * 1e3)  # type: ignore[operator]
    row["fraction_of_copy_bw"] = row["bandwidth_gbs"] / copy_gbs  # type: ignore[operator]
    if not with_baselines:
        return row
    row["ours_prefill_kernel_us"] = graph_time_us(
        [_ours(kv, i, qs[i], outs[i], None, tiles) for i in range(layers)])
    sdpa_layers = min(layers, 4)
    gathered = [_gather(kv, i, ctx) for i in range(sdpa_layers)]
    kc = [(k.contiguous(), v.contiguous()) for k, v in gathered]
    q4 = [q.unsqueeze(2) for q in qs]
    def gather_then_sdpa(i: int) -> torch.Tensor:
        return _sdpa(q4[i], *_gather(kv, i, ctx), None)

    row["sdpa_pre_gathered_us"] = graph_time_us(
        [partial(_sdpa, q4[i], kc[i][0], kc[i][1], None) for i in range(sdpa_layers)])
    row["gather_plus_sdpa_us"] = graph_time_us(
        [partial(gather_then_sdpa, i) for i in range(sdpa_layers)])
    ref = _sdpa(q4[0], kc[0][0], kc[0][1], None).squeeze(2)
    _ours(kv, 0, qs[0], outs[0], 1, tiles)()
    row["check_rel_diff_vs_sdpa"] = float((outs[0].double() - ref.double()).norm()
                                          / ref.double().norm())
    return row


def prefill_case(model: str, ctx_and_queries: list[tuple[int, int]],
                 tiles: AttentionTiles = DEFAULT_TILES,
                 with_baselines: bool = True) -> dict[str, object]:
    heads, _, _ = MODELS[model]
    kv = build_kv(model, ctx_and_queries)
    layers = min(len(kv.k), 4)
    total = sum(n for _, n in ctx_and_queries)
    qs = [torch.randn(total, heads, HEAD_DIM, dtype=DTYPE, device=DEVICE) for _ in range(layers)]
    outs = [torch.empty_like(q) for q in qs]
    visible = sum(n * (c - n) + n * (n + 1) // 2 for c, n in ctx_and_queries)
    flops = 4 * visible * heads * HEAD_DIM
    row: dict[str, object] = {"model": model, "sequences": [list(s) for s in ctx_and_queries]}
    row["ours_us"] = graph_time_us([_ours(kv, i, qs[i], outs[i], None, tiles)
                                    for i in range(layers)])
    row["ours_tflops"] = flops / (row["ours_us"] * 1e6)  # type: ignore[operator]
    if not with_baselines or len({s for s in ctx_and_queries}) != 1:
        return row
    ctx, n = ctx_and_queries[0]
    batch = len(ctx_and_queries)
    mask: object = True if ctx == n else causal_lower_right(n, ctx)
    kc = [tuple(t.contiguous() for t in _gather(kv, i, ctx)) for i in range(layers)]
    q4 = [q.view(batch, n, heads, HEAD_DIM).transpose(1, 2) for q in qs]
    row["sdpa_pre_gathered_us"] = graph_time_us(
        [partial(_sdpa, q4[i], kc[i][0], kc[i][1], mask) for i in range(layers)])
    row["sdpa_tflops"] = flops / (row["sdpa_pre_gathered_us"] * 1e6)  # type: ignore[operator]
    ref = _sdpa(q4[0], kc[0][0], kc[0][1], mask).transpose(1, 2).reshape(total, heads, HEAD_DIM)
    _ours(kv, 0, qs[0], outs[0], None, tiles)()
    row["check_rel_diff_vs_sdpa"] = float((outs[0].double() - ref.double()).norm()
                                          / ref.double().norm())
    return row
