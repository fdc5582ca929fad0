"""The named views of a graph step's packed buffers tile each flat buffer exactly once."""

from __future__ import annotations

from dataclasses import fields

import numpy as np
import torch

from slora_core.graph_buffers import BufferLayout, GraphBuffers


def test_views_tile_the_flat_buffers_without_overlap():
    layout = BufferLayout(tokens=10, seqs=3, segments=3, tiles=5, max_blocks=4, sampled=3,
                          query_starts=4)
    host = layout.host()
    names = [f.name for f in fields(GraphBuffers) if f.name not in ("i64", "i32")]
    for i, name in enumerate(names, start=1):
        getattr(host, name)[...] = i
    for flat in (host.i64, host.i32):
        assert (flat > 0).all()  # every element belongs to some field
    counts = {name: int((getattr(host, name) == i).sum()) for i, name in enumerate(names, 1)}
    assert counts == {"input_ids": 10, "positions": 10, "slot_mapping": 10,
                      "logits_indices": 3, "seq_lens": 3, "query_starts": 4,
                      "token_slots": 10, "seg_starts": 3, "seg_lens": 3, "seg_slots": 3,
                      "tile_segs": 5, "tile_m0": 5, "block_tables": 12}
    assert host.block_tables.shape == (3, 4)
    # The device buffers share the layout: a flat copy lands every field in its place.
    dev = layout.device(torch.device("cpu"))
    dev.i64.copy_(torch.from_numpy(host.i64))
    dev.i32.copy_(torch.from_numpy(host.i32))
    for name in names:
        assert np.array_equal(getattr(dev, name).numpy(), getattr(host, name)), name


def test_fields_a_graph_does_not_buffer_are_empty():
    layout = BufferLayout(tokens=4, seqs=4, segments=4, tiles=4, max_blocks=2)
    host = layout.host()
    assert host.logits_indices.size == 0 and host.query_starts.size == 0
    assert host.i64.size == 12 and host.i32.size == 4 * 7 + 8
