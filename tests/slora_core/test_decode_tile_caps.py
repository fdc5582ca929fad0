"""Decode graphs' LoRA tile-list capacities (slora_core.cuda_graphs.decode_tile_caps): the
longest list holds every step the tile kernels can get, beside the row kernels too, and the
shorter lists come in the order steps try them."""

from __future__ import annotations

import numpy as np
import pytest

from slora_core.cuda_graphs import (
    ROW_GRAPH,
    decode_lora_graph,
    decode_split_tiles,
    decode_tile_caps,
    tile_steps_max_tiles,
)
from slora_kernels.lora_meta import DECODE_BLOCK_M, lora_tiles


def _most_tiles(bucket: int, max_rows: int) -> int:
    """The most 16-row tiles (as the tile builder counts them) of any step of at most
    `bucket` rows in S segments that the row kernels leave to the tiles (rows > max_rows * S):
    for each (rows, S), S - 1 one-row segments and the rest in one is the worst layout."""
    most = 0
    for n in range(1, bucket + 1):
        for s in range(1, n + 1):
            if max_rows and n <= max_rows * s:
                continue
            lens = np.array([1] * (s - 1) + [n - s + 1], dtype=np.int64)
            most = max(most, lora_tiles(lens, DECODE_BLOCK_M)[0].size)
    return most


@pytest.mark.parametrize("max_rows", [0, 1, 2, 3])
def test_longest_list_holds_every_tile_step(max_rows: int) -> None:
    for bucket in (1, 2, 3, 8, 17, 24, 48, 64, 96):
        # Never shorter than the short list: steps that fit it take it before the rows'.
        want = max(_most_tiles(bucket, max_rows), -(-bucket // DECODE_BLOCK_M))
        assert tile_steps_max_tiles(bucket, max_rows) == want, (bucket, max_rows)


def test_caps_longest_first() -> None:
    assert decode_tile_caps(64, None) == [64, 16, 4]  # no row kernels: one tile a row
    assert decode_tile_caps(64, 2) == [33, 16, 4]
    assert decode_tile_caps(256, 2) == [135, 64, 16]
    assert decode_tile_caps(48, 2) == [24, 3]  # no middle list under 64 rows
    assert decode_tile_caps(1, 2) == [1]
    for bucket in (2, 16, 64, 96, 512):
        for max_rows in (None, 0, 2):
            caps = decode_tile_caps(bucket, max_rows)
            assert caps == sorted(set(caps), reverse=True)
            assert caps[-1] == -(-bucket // DECODE_BLOCK_M)


def test_split_tiles() -> None:
    """Lists of up to 16 tiles pick their own split; longer ones the split for at least the
    bucket's rows (up to 64) and the longest list."""
    assert [decode_split_tiles(64, c, 2) for c in decode_tile_caps(64, 2)] == [64, 16, 4]
    assert [decode_split_tiles(256, c, 2) for c in decode_tile_caps(256, 2)] == [135, 135, 16]
    assert [decode_split_tiles(48, c, 2) for c in decode_tile_caps(48, 2)] == [48, 3]
    assert [decode_split_tiles(32, c, None) for c in decode_tile_caps(32, None)] == [32, 2]


def test_lora_graph_choice() -> None:
    """The short list first, then the row kernels for few rows an adapter, then the shortest
    list that holds the real tiles (the middle one only when used)."""
    assert decode_lora_graph(64, 4, 64, 1, 2) == 4  # one adapter on every row
    assert decode_lora_graph(64, 40, 40, 40, 2) == ROW_GRAPH  # a row each
    assert decode_lora_graph(64, 16, 64, 16, 2) == 16  # 16 adapters of 4 rows
    assert decode_lora_graph(64, 16, 64, 16, 2, use_mid_tiles=False) == 33
    assert decode_lora_graph(64, 20, 64, 20, 2) == 33
    assert decode_lora_graph(64, 40, 40, 40, None) == 64  # no row kernels: a tile a row
    with pytest.raises(RuntimeError, match="more than the decode graphs' lists"):
        decode_lora_graph(64, 40, 64, 20, 2)  # more tiles than 20 segments on 64 rows hold
