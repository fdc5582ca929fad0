"""The static inputs of a CUDA-graph step, by name: views into two flat buffers (int64 token
arrays, int32 metadata) so a step costs two host-to-device copies. One layout gives the same
views over the host staging arrays a step fills and the device buffers a graph reads."""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Generic, TypeVar

import numpy as np
import torch

Buf = TypeVar("Buf", np.ndarray, torch.Tensor)


@dataclass(frozen=True)
class GraphBuffers(Generic[Buf]):
    """Named views; `i64` and `i32` are the flat buffers they share. A field a graph does not
    read from the buffers (decode graphs' logits_indices and query_starts: fixed aranges) is an
    empty view."""

    i64: Buf
    i32: Buf
    input_ids: Buf  # int64 [tokens]
    positions: Buf  # int64 [tokens]
    slot_mapping: Buf  # int64 [tokens]: KV row, -1 = a padding token that writes no KV
    logits_indices: Buf  # int64 [sampled]
    seq_lens: Buf  # int32 [seqs]
    query_starts: Buf  # int32 [seqs + 1]
    token_slots: Buf  # int32 [tokens]: adapter slot per token
    seg_starts: Buf  # int32 [segments]: LoRA segments (runs of tokens on one adapter slot)
    seg_lens: Buf  # int32 [segments]
    seg_slots: Buf  # int32 [segments]
    tile_segs: Buf  # int32 [tiles]: LoRA tile list, -1 = unused entry
    tile_m0: Buf  # int32 [tiles]
    block_tables: Buf  # int32 [seqs, max_blocks]


@dataclass(frozen=True)
class BufferLayout:
    """Capacities of each field (`sampled`, `query_starts`: 0 where the graph has none)."""

    tokens: int
    seqs: int
    segments: int
    tiles: int
    max_blocks: int
    sampled: int = 0
    query_starts: int = 0

    def _sizes(self) -> tuple[dict[str, int], dict[str, int]]:
        t, s, g, k = self.tokens, self.seqs, self.segments, self.tiles
        i64 = {"input_ids": t, "positions": t, "slot_mapping": t, "logits_indices": self.sampled}
        i32 = {"seq_lens": s, "query_starts": self.query_starts, "token_slots": t,
               "seg_starts": g, "seg_lens": g, "seg_slots": g, "tile_segs": k, "tile_m0": k,
               "block_tables": s * self.max_blocks}
        return i64, i32

    def device(self, device: torch.device) -> GraphBuffers[torch.Tensor]:
        """Zeroed device buffers."""
        i64, i32 = (sum(sizes.values()) for sizes in self._sizes())
        return self.view(torch.zeros(i64, dtype=torch.int64, device=device),
                         torch.zeros(i32, dtype=torch.int32, device=device))

    def host(self) -> GraphBuffers[np.ndarray]:
        """Zeroed host staging arrays."""
        i64, i32 = (sum(sizes.values()) for sizes in self._sizes())
        return self.view(np.zeros(i64, dtype=np.int64), np.zeros(i32, dtype=np.int32))

    def view(self, i64: Buf, i32: Buf) -> GraphBuffers[Buf]:
        views: dict[str, Buf] = {"i64": i64, "i32": i32}
        for flat, sizes in zip((i64, i32), self._sizes(), strict=True):
            start = 0
            for name, size in sizes.items():
                views[name] = flat[start : start + size]
                start += size
        views["block_tables"] = views["block_tables"].reshape(self.seqs, self.max_blocks)
        assert set(views) == {f.name for f in fields(GraphBuffers)}
        return GraphBuffers(**views)
