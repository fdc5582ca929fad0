"""An adapter parsed from files sits in the host tier as its page image: loading it copies runs
of consecutive pages, and the arena then holds exactly what the per-matrix copy writes."""

from __future__ import annotations

from pathlib import Path

import torch

from slora_core.config import MODULE_INDEX, EngineConfig
from slora_core.engine import LLMEngine


def test_image_load_equals_per_matrix_load(demo_dir: Path) -> None:
    engine = LLMEngine.from_model_dir(demo_dir / "model", EngineConfig(num_pages=256))
    engine.register_adapter("big", demo_dir / "adapters" / "all-r64", preload=False)
    host = engine.adapters.get("big")
    assert host.image is not None
    n = host.layout.num_pages
    assert n >= 4, "the test needs an adapter spanning several pages"
    assert host.nbytes == host.image.numel() * host.image.element_size()
    arena = engine.runner.arena
    # Runs of consecutive pages, a gap, a page before the others: every copy-run boundary.
    by_image = [40 + i for i in range(n // 2)] + [5] + [80 + i for i in range(n - n // 2 - 1)]
    by_matrix = list(range(250 - n, 250))[::-1]  # descending: no two pages consecutive
    assert max(by_image) < min(by_matrix)
    arena.pages.fill_(float("nan"))
    arena.write_adapter(1, by_image, host.layout, host.matrices, host.image)
    arena.write_adapter(2, by_matrix, host.layout, host.matrices)
    t, flat = arena.tables, arena.tables.arena
    for (layer, module), w in host.adapter.weights.items():
        m = MODULE_INDEX[module]
        for slot in (1, 2):
            a0, b0 = int(t.a_offsets[layer, slot, m]), int(t.b_offsets[layer, slot, m])
            assert torch.equal(flat[a0:a0 + w.a.numel()].view(w.a.shape), w.a)
            assert torch.equal(flat[b0:b0 + w.b.numel()].view(w.b.shape), w.b)
        a, b = host.matrices[(layer, module)]
        assert torch.equal(a, w.a) and torch.equal(b, w.b)
    assert torch.equal(t.ranks[:, 1], t.ranks[:, 2])
    assert torch.equal(t.scales[:, 1], t.scales[:, 2])
    # The image copy wrote whole pages, and only the adapter's.
    written = ~torch.isnan(arena.pages).all(dim=1)
    assert sorted(written.nonzero().flatten().tolist()) == sorted(by_image + by_matrix)
