"""LoRA shrink+expand benchmark cases: ours beside gather+bmm, a per-adapter GEMM loop and the
bytes floor, on one 4096x4096 module (q_proj of a 7B/8B model) in fp16."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from bench.kernels_timing import DEVICE, graph_time_us, rotation_count
from slora_kernels.lora import LoraTiles, add_lora_triton
from slora_kernels.lora_meta import LoraMeta

K = N = 4096
DTYPE = torch.float16
# Per-token gathers of whole adapters above this size are not run (they only grow linearly).
MAX_GATHER_BYTES = 6 << 30


@dataclass
class LoraLayer:
    """One rotation entry: its own adapter matrices, tables and activations."""

    arena: torch.Tensor  # 1-D, shared by all layers of the rotation
    a_stack: torch.Tensor  # [adapters, r, K], a view into the arena
    b_stack: torch.Tensor  # [adapters, N, r]
    a_offsets: torch.Tensor
    b_offsets: torch.Tensor
    ranks: torch.Tensor
    scales: torch.Tensor
    x: torch.Tensor
    y: torch.Tensor


def build_layers(token_slots: list[int], adapters: int, rank: int) -> list[LoraLayer]:
    """Enough layers, each with its adapters packed in one arena, to cycle past the L2."""
    per_layer = adapters * (rank * K + N * rank) * 2 + len(token_slots) * (K + 2 * N) * 2
    count = rotation_count(per_layer)
    a_numel, b_numel = adapters * rank * K, adapters * N * rank
    arena = torch.empty(count * (a_numel + b_numel), dtype=DTYPE, device=DEVICE)
    arena.normal_(0, 0.02)
    layers = []
    slot_ids = torch.arange(adapters, device=DEVICE, dtype=torch.int64)
    for i in range(count):
        base = i * (a_numel + b_numel)
        a_off = torch.zeros(adapters, 7, dtype=torch.int64, device=DEVICE)
        b_off = torch.zeros_like(a_off)
        ranks = torch.zeros(adapters, 7, dtype=torch.int32, device=DEVICE)
        a_off[:, 0] = base + slot_ids * rank * K
        b_off[:, 0] = base + a_numel + slot_ids * N * rank
        ranks[:, 0] = rank
        scales = torch.full((adapters, 7), 2.0, device=DEVICE)
        layers.append(LoraLayer(
            arena=arena,
            a_stack=arena[base : base + a_numel].view(adapters, rank, K),
            b_stack=arena[base + a_numel : base + a_numel + b_numel].view(adapters, N, rank),
            a_offsets=a_off, b_offsets=b_off, ranks=ranks, scales=scales,
            x=torch.randn(len(token_slots), K, dtype=DTYPE, device=DEVICE),
            y=torch.randn(len(token_slots), N, dtype=DTYPE, device=DEVICE),
        ))
    return layers


def ours(layer: LoraLayer, meta: LoraMeta, rank: int,
         tiles: LoraTiles | None = None) -> Callable[[], None]:
    return lambda: add_lora_triton(layer.y, layer.x, layer.arena, layer.a_offsets,
                                   layer.b_offsets, layer.ranks, layer.scales, (0,), ((0, N),),
                                   meta, max_rank=rank, tiles=tiles)


def gather_bmm(layer: LoraLayer, slots: torch.Tensor) -> Callable[[], None]:
    """(a): index the stacked A and B per request, two bmm calls, scale, add."""
    scale = layer.scales[slots.clamp_min(0), 0].to(DTYPE)[:, None]

    def call() -> None:
        a = layer.a_stack[slots]  # [T, r, K]
        h = torch.bmm(layer.x.unsqueeze(1), a.transpose(1, 2))
        b = layer.b_stack[slots]  # [T, N, r]
        delta = torch.bmm(h, b.transpose(1, 2)).squeeze(1)
        layer.y.add_(delta * scale)

    return call


def gemm_loop(layer: LoraLayer, meta: LoraMeta) -> Callable[[], None]:
    """(b): one GEMM pair per adapter segment, in a Python loop (captured into the graph)."""
    segs = list(zip(meta.seg_starts.tolist(), meta.seg_lens.tolist(), meta.seg_slots.tolist(),
                    strict=True))
    scales = layer.scales[:, 0].tolist()

    def call() -> None:
        for start, n, slot in segs:
            h = layer.x[start : start + n] @ layer.a_stack[slot].T
            layer.y[start : start + n].addmm_(h, layer.b_stack[slot].T, alpha=scales[slot])

    return call


def floor_bytes(num_tokens: int, adapters: int, rank: int) -> int:
    """Adapter weights read once per distinct adapter; x read, y read and written once."""
    return adapters * (rank * K + N * rank) * 2 + num_tokens * (K + 2 * N) * 2


def max_rel_diff(layer: LoraLayer, meta: LoraMeta, rank: int) -> float:
    """Our delta against the GEMM loop's on the same inputs (a consistency check)."""
    y0 = layer.y.clone()
    ours(layer, meta, rank)()
    mine = layer.y.double() - y0.double()
    layer.y.copy_(y0)
    gemm_loop(layer, meta)()
    theirs = layer.y.double() - y0.double()
    layer.y.copy_(y0)
    return float((mine - theirs).norm() / theirs.norm())


def run_case(token_slots: list[int], adapters: int, rank: int, copy_gbs: float,
             with_baselines: bool = True, tiles: LoraTiles | None = None) -> dict[str, object]:
    """Time ours (and the baselines) for one batch; returns a JSON-ready row."""
    meta = LoraMeta.from_token_slots(token_slots, device=DEVICE)
    slots = meta.token_slots.long()
    layers = build_layers(token_slots, adapters, rank)
    t = len(token_slots)
    row: dict[str, object] = {"tokens": t, "adapters": adapters, "rank": rank,
                              "segments": meta.num_segments, "rotation": len(layers)}
    row["ours_us"] = graph_time_us([ours(lay, meta, rank, tiles) for lay in layers])
    nbytes = floor_bytes(t, adapters, rank)
    row["floor_us"] = nbytes / (copy_gbs * 1e3)
    row["ours_over_floor"] = row["ours_us"] / row["floor_us"]  # type: ignore[operator]
    if not with_baselines:
        return row
    row["check_rel_diff_vs_loop"] = max_rel_diff(layers[0], meta, rank)
    if t * rank * (K + N) * 2 <= MAX_GATHER_BYTES:
        row["gather_bmm_us"] = graph_time_us([gather_bmm(lay, slots) for lay in layers[:4]])
        row["speedup_vs_gather_bmm"] = row["gather_bmm_us"] / row["ours_us"]  # type: ignore[operator]
    row["gemm_loop_us"] = graph_time_us([gemm_loop(lay, meta) for lay in layers])
    row["speedup_vs_gemm_loop"] = row["gemm_loop_us"] / row["ours_us"]  # type: ignore[operator]
    del layers
    torch.cuda.empty_cache()
    return row


def decode_slots(batch: int, adapters: int) -> list[int]:
    """Requests spread evenly over adapters, sorted so requests sharing one are adjacent."""
    return sorted(i % adapters for i in range(batch))


def prefill_slots(requests: int, tokens_each: int, adapters: int) -> list[int]:
    return [s for s in sorted(i % adapters for i in range(requests)) for _ in range(tokens_each)]
