"""The page arena's tensors: one [num_pages, page_numel] tensor holding KV blocks and adapter
weights, the per-layer KV views the attention kernels read, and the LoRA offset tables.

Which page holds what is decided by `PagePool`; this module only moves data.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from slora_core.config import LORA_MODULES, MODULE_INDEX, ModelConfig
from slora_core.context import LoraTables
from slora_core.page_pool import pack_matrices


@dataclass(frozen=True)
class AdapterLayout:
    """Where each (layer, module) A and B matrix of one adapter goes, relative to its pages."""

    num_pages: int
    # (layer, module) -> (rank, scale, (page_idx, offset) of A, (page_idx, offset) of B)
    entries: dict[tuple[int, str], tuple[int, float, tuple[int, int], tuple[int, int]]]
    # The entries as int64 rows: layer, module index, A page, A offset, B page, B offset, rank
    # [7, n]; scales float64 [n]; module indices of rank > 0. Derived (__post_init__).
    table_rows: np.ndarray = field(init=False, repr=False, compare=False)
    scales: np.ndarray = field(init=False, repr=False, compare=False)
    modules: frozenset[int] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        rows = [(layer, MODULE_INDEX[module], pa, oa, pb, ob, r)
                for (layer, module), (r, _, (pa, oa), (pb, ob)) in self.entries.items()]
        table = np.asarray(rows, dtype=np.int64).reshape(-1, 7).T.copy()
        object.__setattr__(self, "table_rows", table)
        object.__setattr__(self, "scales", np.asarray(
            [e[1] for e in self.entries.values()], dtype=np.float64))
        object.__setattr__(self, "modules", frozenset(
            MODULE_INDEX[module] for (_, module), e in self.entries.items() if e[0] > 0))


def plan_adapter_layout(
    weights: dict[tuple[int, str], tuple[int, int, int, float]], page_numel: int
) -> AdapterLayout:
    """weights: (layer, module) -> (rank, in_features, out_features, scale)."""
    keys = sorted(weights)
    sizes: list[int] = []
    for key in keys:
        r, fan_in, fan_out, _ = weights[key]
        sizes += [r * fan_in, fan_out * r]
    num_pages, placements = pack_matrices(sizes, page_numel)
    entries = {
        key: (weights[key][0], weights[key][3], placements[2 * i], placements[2 * i + 1])
        for i, key in enumerate(keys)
    }
    return AdapterLayout(num_pages=num_pages, entries=entries)


class PageArena:
    """The arena tensor plus offset tables; see DESIGN section 3 for the layout."""

    def __init__(
        self,
        config: ModelConfig,
        num_pages: int,
        block_size: int,
        num_slots: int,
        dtype: torch.dtype,
        device: torch.device | str,
        max_rank: int = 0,
    ) -> None:
        self.config = config
        self.num_pages = num_pages
        self.block_size = block_size
        self.num_slots = num_slots
        L, hkv, d = config.num_hidden_layers, config.num_key_value_heads, config.head_dim
        self.page_numel = block_size * L * 2 * hkv * d
        self.pages = torch.zeros(num_pages, self.page_numel, dtype=dtype, device=device)
        kv = self.pages.view(num_pages, L, 2, block_size, hkv, d)
        self.kv_caches = tuple((kv[:, layer, 0], kv[:, layer, 1]) for layer in range(L))
        shape = (L, num_slots, len(LORA_MODULES))
        self.tables = LoraTables(
            arena=self.pages.view(-1),
            a_offsets=torch.zeros(shape, dtype=torch.int64, device=device),
            b_offsets=torch.zeros(shape, dtype=torch.int64, device=device),
            ranks=torch.zeros(shape, dtype=torch.int32, device=device),
            scales=torch.zeros(shape, dtype=torch.float32, device=device),
            max_rank=max_rank,
        )
        # Host-side record of which modules each filled slot targets (rank > 0 on any layer).
        self._slot_modules: dict[int, frozenset[int]] = {}
        self._module_users = [0] * len(LORA_MODULES)
        self._active: frozenset[int] = frozenset()
        # Bumped whenever a slot is cleared or refilled: (slot, generation) names one load.
        self.slot_generation = [0] * num_slots

    @property
    def active_lora_modules(self) -> frozenset[int]:
        """Module ids that at least one filled slot targets: LoRA launches of the others are
        skipped (an attention-only adapter population costs no MLP LoRA launches)."""
        return self._active

    def _set_slot_modules(self, slot: int, modules: frozenset[int]) -> None:
        for m in self._slot_modules.pop(slot, frozenset()):
            self._module_users[m] -= 1
        if modules:
            self._slot_modules[slot] = modules
            for m in modules:
                self._module_users[m] += 1
        self._active = frozenset(m for m, n in enumerate(self._module_users) if n)

    @property
    def nbytes(self) -> int:
        return self.pages.numel() * self.pages.element_size()

    def write_adapter(
        self,
        slot: int,
        pages: list[int],
        layout: AdapterLayout,
        matrices: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]],
        image: torch.Tensor | None = None,
    ) -> None:
        """Copy an adapter's A/B matrices into its pages and fill its rows of the tables.
        Copies are non-blocking from pinned host memory. With `image` (the adapter's pages as
        laid out, HostAdapter.image), one copy per run of consecutive pages."""
        flat = self.tables.arena
        if image is not None:
            self._write_image(flat, pages, image)
        else:
            for key, (_, _, (pa, oa), (pb, ob)) in layout.entries.items():
                a, b = matrices[key]
                start_a = pages[pa] * self.page_numel + oa
                start_b = pages[pb] * self.page_numel + ob
                flat[start_a : start_a + a.numel()].copy_(a.reshape(-1), non_blocking=True)
                flat[start_b : start_b + b.numel()].copy_(b.reshape(-1), non_blocking=True)
        self.clear_slot(slot)
        rows = layout.table_rows
        if rows.shape[1] == 0:
            return
        self._set_slot_modules(slot, layout.modules)
        # One host->device copy of the slot's table rows, then one scatter per table: the
        # per-table copies and indexed writes cost ~0.2 ms, 1.8x a plain copy of a rank-8
        # adapter's 16 MB (cold-load-h200.json at 9c43cbb).
        page_base = np.asarray(pages, dtype=np.int64) * self.page_numel
        _, S, M = self.tables.ranks.shape
        packed = np.empty((5, rows.shape[1]), dtype=np.int64)
        packed[0] = rows[0] * (S * M) + slot * M + rows[1]  # flat index into the tables
        packed[1] = page_base[rows[2]] + rows[3]  # A offsets
        packed[2] = page_base[rows[4]] + rows[5]  # B offsets
        packed[3] = rows[6]  # ranks
        packed[4] = layout.scales.view(np.int64)  # float64 scales, bit for bit
        dev = self.pages.device
        t = torch.from_numpy(packed).to(dev, non_blocking=True)
        idx = t[0]
        self.tables.a_offsets.view(-1).index_copy_(0, idx, t[1])
        self.tables.b_offsets.view(-1).index_copy_(0, idx, t[2])
        self.tables.ranks.view(-1).index_copy_(0, idx, t[3].to(torch.int32))
        self.tables.scales.view(-1).index_copy_(0, idx, t[4].view(torch.float64).float())

    def _write_image(self, flat: torch.Tensor, pages: list[int], image: torch.Tensor) -> None:
        n = self.page_numel
        if image.numel() != len(pages) * n:
            raise ValueError(f"an adapter image of {image.numel()} elements for {len(pages)} "
                             f"pages of {n}")
        i = 0
        while i < len(pages):
            j = i + 1
            while j < len(pages) and pages[j] == pages[j - 1] + 1:
                j += 1
            flat[pages[i] * n : pages[j - 1] * n + n].copy_(image[i * n : j * n],
                                                            non_blocking=True)
            i = j

    def clear_slot(self, slot: int) -> None:
        """Mark a slot empty (rank 0 everywhere) so no kernel reads its stale pages."""
        self.tables.ranks[:, slot].zero_()
        self.tables.scales[:, slot].zero_()
        self.slot_generation[slot] += 1
        self._set_slot_modules(slot, frozenset())
