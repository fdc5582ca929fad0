"""Torch reference for the segmented multi-LoRA delta read from the page arena.

Semantics, for every segment s (a run of tokens that share one adapter slot) and every module m
in `module_ids` with rank r = ranks[slot, m] > 0:

    A = arena[a_offsets[slot, m] : + r * K].view(r, K)              # PEFT lora_A.weight layout
    B = arena[b_offsets[slot, m] : + N_m * r].view(N_m, r)          # PEFT lora_B.weight layout
    y[tokens of s, out_slices[m]] += scales[slot, m] * (x[tokens of s] @ A.T) @ B.T

Shapes: y [T, N_total] (updated in place), x [T, K], arena 1-D (the flattened page arena),
a_offsets/b_offsets [num_slots, num_modules] int64 element offsets, ranks [num_slots,
num_modules] int32, scales [num_slots, num_modules] float32 (the tables of one layer).
Tokens of no segment (base-model requests) are left untouched.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

# Token rows per kernel tile: decode-like steps (every segment at most 16 tokens) use 16-row
# tiles, longer segments (prefill) 64-row ones. The tile list is built for one of these.
DECODE_BLOCK_M = 16
PREFILL_BLOCK_M = 64


def tile_rows(max_seg_len: int) -> int:
    """The tile height for a step whose longest segment has `max_seg_len` tokens."""
    return DECODE_BLOCK_M if max_seg_len <= DECODE_BLOCK_M else PREFILL_BLOCK_M


@dataclass(frozen=True)
class LoraMeta:
    """Per-step segment metadata, built once per step and shared by every layer.

    The kernels' programs walk a tile list: tile i covers rows tile_m0[i] .. + block_m of
    segment tile_segs[i] (-1: an unused entry, so CUDA graphs can capture a fixed-size list).
    A segment of n tokens is read as cdiv(n, block_m) tiles, each loading the adapter once:
    many decode requests on one adapter share its reads."""

    seg_starts: torch.Tensor  # [S] int32: first token of each segment
    seg_lens: torch.Tensor  # [S] int32
    seg_slots: torch.Tensor  # [S] int32: adapter slot of each segment
    token_slots: torch.Tensor  # [T] int32: adapter slot of each token, -1 = none
    max_seg_len: int  # host-side
    num_segments: int  # host-side
    tile_segs: torch.Tensor  # [>= num_tiles] int32: segment of each tile, -1 = unused
    tile_m0: torch.Tensor  # [>= num_tiles] int32: first row of each tile within its segment
    num_tiles: int  # host-side: kernel grid size along tiles
    block_m: int  # host-side: rows per tile the list was built for

    @staticmethod
    def from_token_slots(token_slots: list[int], device: torch.device | str = "cpu",
                         block_m: int | None = None) -> LoraMeta:
        """Segments are maximal runs of equal slots >= 0 in `token_slots`."""
        slots = np.asarray(token_slots, dtype=np.int64)
        starts, lens, seg_slots = lora_segments(slots)
        max_len = int(lens.max()) if lens.size else 0
        block_m = block_m or tile_rows(max_len)
        tile_segs, tile_m0 = lora_tiles(lens, block_m)

        def t(v: np.ndarray) -> torch.Tensor:
            return torch.as_tensor(v, dtype=torch.int32, device=device)

        return LoraMeta(
            seg_starts=t(starts), seg_lens=t(lens), seg_slots=t(seg_slots),
            token_slots=t(slots), max_seg_len=max_len, num_segments=int(starts.size),
            tile_segs=t(tile_segs), tile_m0=t(tile_m0), num_tiles=int(tile_segs.size),
            block_m=block_m,
        )


def lora_segments(token_slots: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Maximal runs of equal slots >= 0 in a 1-D int array: (starts, lengths, slots)."""
    if token_slots.size == 0:
        empty = np.zeros(0, dtype=np.int64)
        return empty, empty, empty
    change = np.flatnonzero(np.diff(token_slots)) + 1
    starts = np.concatenate(([0], change))
    ends = np.concatenate((change, [token_slots.size]))
    keep = token_slots[starts] >= 0
    return starts[keep], (ends - starts)[keep], token_slots[starts][keep]


def lora_tiles(seg_lens: np.ndarray, block_m: int) -> tuple[np.ndarray, np.ndarray]:
    """The tile list of segments of these lengths: (segment of each tile, first row)."""
    per_seg = -(-seg_lens.astype(np.int64) // block_m)
    segs = np.repeat(np.arange(seg_lens.size, dtype=np.int64), per_seg)
    first = np.cumsum(per_seg) - per_seg  # index of each segment's first tile
    m0 = (np.arange(segs.size, dtype=np.int64) - np.repeat(first, per_seg)) * block_m
    return segs, m0


def add_lora_reference(
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
) -> None:
    """y += the multi-LoRA delta of x (see module docstring). Computes in float32."""
    if meta.num_segments == 0:
        return
    k = x.shape[1]
    starts = meta.seg_starts.tolist()
    lens = meta.seg_lens.tolist()
    slots = meta.seg_slots.tolist()
    ranks_h = ranks.tolist()
    a_off = a_offsets.tolist()
    b_off = b_offsets.tolist()
    scales_h = scales.tolist()
    for start, n, slot in zip(starts, lens, slots, strict=True):
        xs = x[start : start + n].float()
        for m, (o_start, o_size) in zip(module_ids, out_slices, strict=True):
            r = ranks_h[slot][m]
            if r == 0:
                continue
            a = arena[a_off[slot][m] : a_off[slot][m] + r * k].view(r, k).float()
            b = arena[b_off[slot][m] : b_off[slot][m] + o_size * r].view(o_size, r).float()
            delta = (xs @ a.T) @ b.T * scales_h[slot][m]
            y[start : start + n, o_start : o_start + o_size] += delta.to(y.dtype)
