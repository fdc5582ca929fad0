"""Per-step LoRA segment metadata (`LoraMeta`) and the segment / tile lists it is built from.

A segment is a maximal run of tokens that share one adapter slot; the kernels' programs walk a
tile list of (segment, first row) pairs, each tile covering `block_m` rows of one segment.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import numpy as np
import torch

# Token rows per kernel tile: decode-like steps (every segment at most 16 tokens) use 16-row
# tiles, longer segments (prefill) 64-row ones. The tile list is built for one of these.
DECODE_BLOCK_M = 16
PREFILL_BLOCK_M = 64
# A meta built for one-row tiles runs the row kernels (`slora_kernels.lora_rows`): each token reads
# its own adapter through `token_slots`, with no tile list (decode steps of many adapters).
ROW_BLOCK_M = 1


# Steps of at most this many tokens run 16-row tiles whatever their segments, larger ones
# 64-row tiles when a segment is longer than 16. H100, one 7B layer's LoRA as a mixed graph
# launches it (`python -m bench.lora_distinct_layer`, lora-distinct-layer-mixed-a92205a-h100.json,
# -prefill-a92205a-h100.json and -prefill-long-a92205a-h100.json): 64 one-row decode segments
# of ranks 8-64 beside a 256-token prompt chunk 534.3 -> 244.8 us; 16 adapters x 4 rows beside
# 256 tokens 257.5 -> 124.2, beside 1,024 tokens 332.8 -> 222.3; 64 rows of one adapter
# beside a 2,048-token chunk r16 354.7 -> 324.2, r64 433.6 -> 432.3; beside 4,032 tokens r16
# 600.3 -> 584.7 but r64 721.5 -> 771.3. A 64-row tile of one decode row reads its adapter in
# at most 2 K splits (PREFILL_TILES) into 64 rows of padding; 16-row tiles split up to 16 ways.
SHORT_TILES_MAX_TOKENS = 2048


def tile_rows(max_seg_len: int, num_tokens: int | None = None) -> int:
    """The tile height for a step whose longest segment has `max_seg_len` tokens, of
    `num_tokens` tokens in all (SHORT_TILES_MAX_TOKENS; None: by the segment alone)."""
    if max_seg_len <= DECODE_BLOCK_M or (num_tokens is not None
                                         and num_tokens <= SHORT_TILES_MAX_TOKENS):
        return DECODE_BLOCK_M
    return PREFILL_BLOCK_M


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
    # [T] int32: the token rows in adapter order, when the tokens do not come grouped by
    # adapter (segments then index this list); None: segments index token rows directly.
    token_rows: torch.Tensor | None = None
    # host-side: the tile count the tile launches pick their K split for (None: num_tiles).
    # A CUDA graph's list is padded past its real tiles, and the split that suits them need
    # not be the one for the padded length (slora_core.cuda_graphs.decode_split_tiles).
    split_tiles: int | None = None
    # host-side: LoraTiles fields the tile launches take instead of their tiles' (name,
    # value; the last of a name wins): decode graphs' pipeline stages
    # (slora_core.cuda_graphs.GRAPH_TILE_STAGES), their many-adapter lists' expand column
    # tiles (MANY_TILE_OVERRIDES), a benchmark's variants (DecodeGraphs.tile_overrides).
    tile_overrides: tuple[tuple[str, int], ...] = ()

    def rows_or_slots(self) -> torch.Tensor:
        """A pointer argument for the kernels' row list (read only when `token_rows` is set)."""
        return self.token_rows if self.token_rows is not None else self.token_slots

    @staticmethod
    def from_token_slots(token_slots: list[int], device: torch.device | str = "cpu",
                         block_m: int | None = None) -> LoraMeta:
        """One segment per adapter slot >= 0 in `token_slots`. Tokens grouped by adapter (as
        the scheduler orders them) make maximal runs, read in place; otherwise the tokens are
        sorted by slot (stably) into `token_rows` and the segments are runs of that order, so
        an adapter's rows share its reads however the batch interleaves them."""
        slots = np.asarray(token_slots, dtype=np.int64)
        starts, lens, seg_slots = lora_segments(slots)
        order = None
        if np.unique(seg_slots).size < seg_slots.size:  # some adapter in more than one run
            order = np.argsort(slots, kind="stable")
            starts, lens, seg_slots = lora_segments(slots[order])
        max_len = int(lens.max()) if lens.size else 0
        block_m = block_m or tile_rows(max_len)
        tile_segs, tile_m0 = lora_tiles(lens, block_m)

        def t(v: np.ndarray) -> torch.Tensor:
            return torch.as_tensor(v, dtype=torch.int32, device=device)

        return LoraMeta(
            seg_starts=t(starts), seg_lens=t(lens), seg_slots=t(seg_slots),
            token_slots=t(slots), max_seg_len=max_len, num_segments=int(starts.size),
            tile_segs=t(tile_segs), tile_m0=t(tile_m0), num_tiles=int(tile_segs.size),
            block_m=block_m, token_rows=None if order is None else t(order),
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


def _tiles_per_segment(seg_lens: np.ndarray, block_m: int) -> np.ndarray:
    return -(-seg_lens.astype(np.int64) // block_m)


def lora_tile_count(seg_lens: np.ndarray, block_m: int) -> int:
    """How many tiles `lora_tiles` lists for segments of these lengths (without the list)."""
    return int(_tiles_per_segment(seg_lens, block_m).sum())


def lora_tiles(seg_lens: np.ndarray, block_m: int) -> tuple[np.ndarray, np.ndarray]:
    """The tile list of segments of these lengths: (segment of each tile, first row)."""
    per_seg = _tiles_per_segment(seg_lens, block_m)
    segs = np.repeat(np.arange(seg_lens.size, dtype=np.int64), per_seg)
    first = np.cumsum(per_seg) - per_seg  # index of each segment's first tile
    m0 = (np.arange(segs.size, dtype=np.int64) - np.repeat(first, per_seg)) * block_m
    return segs, m0


class RideBlocks(NamedTuple):
    """The launch shape of the ride's expand launchers (ride_expand, rotary's and silu_mul's
    fused expands): rows a program covers, and warps a program."""

    m: int
    warps: int = 4


def ride_blocks(tokens: int) -> RideBlocks:
    """The ride's expand launch for `tokens` rows: 16 rows a program for decode-sized steps
    (more programs), 64 past 128 tokens, where each program re-reads its expand-matrix tile
    and 16 rows would re-read it 4x as often (prefill chunks in the mixed graphs); 4 warps.
    No other shape beat it in the engine on an H100, at ranks 8 and 64 (32 or 64 rows, or 8
    warps, at every step; docs/performance.md)."""
    return RideBlocks(16 if tokens <= 128 else 64)
