"""Sole-adapter merge (EngineConfig.merge_sole_adapter): when every token of a run of steps
reads one adapter, that adapter is folded into the base weights and those steps run as the
base model, with no LoRA launch at all.

    W[rows of module m] += scale_m * B_m @ A_m      (peft's merge; one rounding, in the GEMM)

for every module slice of every wrapped projection. Any step that reads anything else (another
adapter, several, or base-model rows) first restores the base weights from a device copy taken
at start-up, bit for bit, so merging never drifts them, and then runs as usual. Merge and
restore are stream-ordered device work: an asynchronous step still in flight finishes with the
weights it was launched with.

The trade: one copy of the wrapped projections' weights on the device (Llama-2-7B: 12.9 GB),
a merge (~the time to read and write those weights once) when a sole adapter has held
`after` steps in a row, and a restore (one device copy) when it stops. Traffic that switches
often would pay those again and again, so a merge that held fewer steps than it waited for
doubles the wait (up to MAX_MERGE_AFTER); one that held long halves it again.

Merged steps compute (W + s B A) x rather than W x + s B (A x): the same function, rounded
differently (what peft's merge_and_unload serves), so near-ties can pick a different greedy
token than the unmerged path would.
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import torch

from slora_core.arena import PageArena
from slora_core.lora import LoraLinear
from slora_core.step_inputs import StepInputs

# Steps in a row on one sole adapter before it is merged (the first wait; see the docstring).
MERGE_AFTER_STEPS = 8
MAX_MERGE_AFTER = 1024

_EMPTY = np.zeros(0, dtype=np.int64)


def without_lora(inputs: StepInputs) -> StepInputs:
    """The step as the base model runs it: every token on no adapter, no segments."""
    return replace(inputs, token_slots=np.full(inputs.num_tokens, -1, dtype=np.int64),
                   seg_starts=_EMPTY, seg_lens=_EMPTY, seg_slots=_EMPTY)


def sole_slot(inputs: StepInputs) -> int | None:
    """The adapter slot every token of the step reads, or None (base rows, several slots)."""
    slots = inputs.seg_slots
    if slots.size == 0 or (inputs.token_slots < 0).any():
        return None
    first = int(slots[0])
    return first if bool((slots == first).all()) else None


class SoleAdapterMerge:
    """Owns the merged state of one model's wrapped projections over one page arena."""

    def __init__(self, model: torch.nn.Module, arena: PageArena) -> None:
        self.arena = arena
        self.layers = [m for m in model.modules() if isinstance(m, LoraLinear)]
        if not self.layers:
            raise ValueError("no LoRA-wrapped projections to merge into (wrap_lora first)")
        with torch.no_grad():
            self._backup = [lin.base.weight.detach().clone() for lin in self.layers]
        self.merged: tuple[int, int] | None = None  # (slot, slot generation) folded in now
        # The weight rows the merge changed: (layer index in self.layers, first row, rows).
        self._touched: list[tuple[int, int, int]] = []
        self.after = MERGE_AFTER_STEPS
        self._streak: tuple[tuple[int, int] | None, int] = (None, 0)
        self._merged_steps = 0
        self.merges = 0
        self.restores = 0
        self.merged_steps = 0  # steps run merged, over the engine's life

    @property
    def nbytes(self) -> int:
        """Device bytes of the base-weight copy."""
        return sum(t.numel() * t.element_size() for t in self._backup)

    def route(self, inputs: StepInputs) -> StepInputs:
        """The step to run: as given (the base weights restored first when merged), or without
        LoRA when its sole adapter is merged (merging it first once it has held long enough)."""
        slot = sole_slot(inputs)
        key = None if slot is None else (slot, self.arena.slot_generation[slot])
        if key is not None and key == self.merged:
            self._merged_steps += 1
            self.merged_steps += 1
            return without_lora(inputs)
        last, n = self._streak
        self._streak = (key, n + 1 if key == last else 1)
        if self.merged is not None:
            self.restore()
        if key is None or self._streak[1] < self.after:
            return inputs
        self.merge(key)
        self._merged_steps = 1
        self.merged_steps += 1
        return without_lora(inputs)

    @torch.no_grad()
    def merge(self, key: tuple[int, int]) -> None:
        """Fold the adapter in `key`'s slot into the (restored) base weights."""
        slot, _ = key
        t = self.arena.tables
        # One read of the slot's table rows (a device sync, once per merge).
        ranks, a_off, b_off, scales = (x[:, slot].cpu() for x in
                                       (t.ranks, t.a_offsets, t.b_offsets, t.scales))
        flat = t.arena
        for i, lin in enumerate(self.layers):
            k = lin.base.in_features
            weight = lin.base.weight
            for m, (start, size) in zip(lin.module_ids, lin.out_slices, strict=True):
                r = int(ranks[lin.layer, m])
                if r == 0:
                    continue
                a0, b0 = int(a_off[lin.layer, m]), int(b_off[lin.layer, m])
                a = flat[a0 : a0 + r * k].view(r, k)
                b = flat[b0 : b0 + size * r].view(size, r)
                weight[start : start + size].addmm_(b.to(weight.dtype), a.to(weight.dtype),
                                                    alpha=float(scales[lin.layer, m]))
                self._touched.append((i, start, size))
        self.merged = key
        self.merges += 1

    def unmerge(self) -> None:
        """Restore the base weights if an adapter is merged (before the model serves anything
        else, e.g. another engine built over the same model)."""
        if self.merged is not None:
            self.restore()

    @torch.no_grad()
    def restore(self) -> None:
        """Put the base weights back as they were loaded (the rows the merge changed), and
        adapt the wait before a merge."""
        for i, start, size in self._touched:
            rows = slice(start, start + size)
            self.layers[i].base.weight[rows].copy_(self._backup[i][rows])
        self._touched.clear()
        if self._merged_steps < self.after:
            self.after = min(2 * self.after, MAX_MERGE_AFTER)
        elif self._merged_steps >= 4 * self.after:
            self.after = max(self.after // 2, MERGE_AFTER_STEPS)
        self.merged = None
        self.restores += 1
