"""Sole-adapter merge (EngineConfig.merge_sole_adapter): when every token of a run of steps
reads one adapter, that adapter is folded into the base weights and those steps run as the
base model, with no LoRA launch at all.

    W[rows of module m] = round(W + scale_m * B_m @ A_m)    (peft's merge; float32 sum, one
                                                             rounding to the weights' dtype)

for every module slice of every wrapped projection. Any step that reads anything else (another
adapter, several, or base-model rows) first restores the base weights bit for bit, so merging
never drifts them, and then runs as usual. Merge and restore are stream-ordered device work: an
asynchronous step still in flight finishes with the weights it was launched with.

The restore keeps no copy of the weights. It recomputes each delta from a copy of the
adapter's A and B taken at the merge (the adapter's own bytes: its arena slot may be refilled
before the restore) and rounds W' - delta back; the merge checked, element by element, where
that does not give W back bit for bit (the merged value rounded into a wider binade, or a
rounding tie) and kept those elements' original values (`_Patch`). Everywhere else the round
trip is exact: |round(W + d) - (W + d)| is at most half a unit in W's last place while W' and
W share a binade, so round(W' - d) is W again. A merge whose exceptions would pass
MAX_EXCEPTION_FRACTION of the merged elements (deltas as large as the weights) is abandoned,
the weights as they were, and not retried soon.

On a GPU with 16-bit weights one Triton launch a module slice checks the round trip, one adds
the delta and one takes it out (slora_kernels.weight_merge: each reads the weights once and computes
the delta's tile in registers); elsewhere torch's float32 (float64 for float32 weights)
passes over chunks of CHUNK_ROWS rows do the same arithmetic.

The trade: the adapter's bytes and the exceptions held while merged (the device copy of every
projection this replaced cost 12.9 GB at Llama-2-7B), a merge about two reads and a write of
the weights and a restore one of each, and a device sync per module slice (or chunk) at the
merge (it counts the exceptions). Traffic that switches often would pay those again and
again, so a merge that held fewer steps than it waited for doubles the wait (up to
MAX_MERGE_AFTER); one that held long halves it again. A merge whose kept values would take
over MAX_FREE_MEMORY_SHARE of the free device memory, or whose temporaries do not fit, is
undone and refused like one with too many exceptions.

Merged steps compute (W + s B A) x rather than W x + s B (A x): the same function, rounded
differently (what peft's merge_and_unload serves), so near-ties can pick a different greedy
token than the unmerged path would.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, replace

import numpy as np
import torch

from slora_core import step_checks
from slora_core.arena import PageArena
from slora_core.lora import LoraLinear
from slora_core.step_inputs import StepInputs
from slora_kernels import weight_merge

# Steps in a row on one sole adapter before it is merged (the first wait; see the docstring).
# Short: a burst's first steps are its prefills, the costliest ones unmerged (~6 ms each at
# Llama-2-7B against ~0.5 ms a decode step), while a merge costs tens of ms (0.14 s of host
# time at 7B on the H200, counting the step in flight); traffic that flaps doubles the wait.
MERGE_AFTER_STEPS = 2
MAX_MERGE_AFTER = 1024
# Weight rows merged (and restored) at a time: bounds the float32 temporaries (2,048 rows of
# an 11,008-wide down_proj: 90 MB each).
CHUNK_ROWS = 2048
# A merge needing exact values for more than this fraction of the elements it changes is
# abandoned (6 bytes an exception: at 1/8 they cost 3/8 of what a copy of the weights would).
MAX_EXCEPTION_FRACTION = 1 / 8
# The kept values of one merge may take at most this share of the device memory free when it
# starts (the arena is sized by the operator, so the merge must not eat the headroom the
# steps' activations need); past it the merge is refused like one with too many exceptions.
MAX_FREE_MEMORY_SHARE = 1 / 2
# Refused adapters remembered (by slot and slot generation); past this the memory starts over.
MAX_REFUSED = 4096


def free_device_bytes(device: torch.device) -> int | None:
    """Device memory free now (the driver's count), or None off CUDA (no limit there)."""
    if device.type != "cuda":
        return None
    return int(torch.cuda.mem_get_info(device)[0])


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


@dataclass
class _Patch:
    """How to restore one merged chunk of weight rows: its delta's factors (copies) and scale,
    and the elements whose round trip is not exact, by flat position in the chunk, with their
    original values."""

    layer: int  # index in SoleAdapterMerge.layers
    start: int  # first weight row
    a: torch.Tensor  # [r, in_features], the arena's dtype
    b: torch.Tensor  # [rows, r]
    scale: float
    positions: torch.Tensor  # int32
    values: torch.Tensor  # the weights' dtype

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.b, self.positions, self.values))


def wide(dtype: torch.dtype) -> torch.dtype:
    """The type merge and restore do their arithmetic in: float32 for 16-bit weights (the
    sum then rounds once more, at 2^-24, before the weights' own rounding), float64 for
    float32 ones."""
    return torch.float64 if dtype == torch.float32 else torch.float32


def delta(a: torch.Tensor, b: torch.Tensor, scale: float, dtype: torch.dtype) -> torch.Tensor:
    """scale * B @ A in `dtype`. Merge and restore call this on the same tensors, so the
    restore subtracts exactly the delta the merge added."""
    return torch.mm(b.to(dtype), a.to(dtype)).mul_(scale)


def _bits(t: torch.Tensor) -> torch.Tensor:
    """The 16- or 32-bit patterns of t, so comparisons see -0.0 and NaN payloads."""
    return t.view({2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()])


@torch.no_grad()
def _checksum(weight: torch.Tensor) -> torch.Tensor:
    """Sum and sum of squares of the weight's bit patterns (int64, wrapping)."""
    bits = _bits(weight).to(torch.int64)
    return torch.stack([bits.sum(), (bits * bits).sum()])


class SoleAdapterMerge:
    """Owns the merged state of one model's wrapped projections over one page arena."""

    def __init__(self, model: torch.nn.Module, arena: PageArena,
                 fused: bool | None = None) -> None:
        self.arena = arena
        self.layers = [m for m in model.modules() if isinstance(m, LoraLinear)]
        if not self.layers:
            raise ValueError("no LoRA-wrapped projections to merge into (wrap_lora first)")
        # Merge, check and restore with one Triton launch a module slice (slora_kernels.weight_merge)
        # instead of torch's float32 passes over chunks of rows: the default for 16-bit
        # weights on a GPU.
        weight = self.layers[0].base.weight
        if fused is None:
            fused = weight.device.type == "cuda" and weight.dtype in weight_merge.DTYPES
        elif fused and weight.dtype not in weight_merge.DTYPES:
            raise ValueError(f"the fused merge needs 16-bit weights, not {weight.dtype}")
        self.fused = fused
        if fused and weight.device.type == "cuda":
            weight_merge.warm_up(weight.dtype, arena.tables.max_rank or 64, weight.device)
        self.merged: tuple[int, int] | None = None  # (slot, slot generation) folded in now
        self._patches: list[_Patch] = []  # what the restore needs, while merged
        # Adapters whose merge was abandoned (see `merge`), by (slot, generation).
        self._refused: set[tuple[int, int]] = set()
        self.after = MERGE_AFTER_STEPS
        self._streak: tuple[tuple[int, int] | None, int] = (None, 0)
        self._merged_steps = 0
        self.merges = 0
        self.restores = 0
        self.merged_steps = 0  # steps run merged, over the engine's life
        self.refusals = 0  # merges abandoned (too many kept values, or no room for them)
        # The most bytes and exceptions one merge held, and the host seconds merges took (they
        # wait for the device: each chunk's exceptions are counted there).
        self.peak_nbytes = 0
        self.peak_exceptions = 0
        self.merge_seconds = 0.0
        # With SLORA_CHECK_INDICES, each restore compares every weight's checksum with the
        # loaded one (a device sync): the restore's exactness rests on the delta's GEMM giving
        # the same bits twice.
        self._checksums = ([_checksum(lin.base.weight) for lin in self.layers]
                           if step_checks.ENABLED else None)

    @property
    def nbytes(self) -> int:
        """Device bytes held to restore the base weights (0 unless merged): the adapter's
        factors and the exceptions."""
        return sum(p.nbytes for p in self._patches) + sum(
            {id(p.a): p.a.numel() * p.a.element_size() for p in self._patches}.values())

    @property
    def exceptions(self) -> int:
        """Elements the current merge keeps exact values of."""
        return sum(int(p.positions.numel()) for p in self._patches)

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
        if key is None or self._streak[1] < self.after or key in self._refused:
            return inputs
        if not self.merge(key):
            return inputs
        self._merged_steps = 1
        self.merged_steps += 1
        return without_lora(inputs)

    @torch.no_grad()
    def merge(self, key: tuple[int, int]) -> bool:
        """Fold the adapter in `key`'s slot into the (restored) base weights; False (weights
        put back, the adapter not tried again while its slot holds it) when too many elements
        would need their exact values kept or what the restore needs does not fit."""
        t0 = time.perf_counter()
        try:
            if self._merge(key):
                return True
        except torch.OutOfMemoryError:
            # The exceptions or a temporary did not fit beside the arena: serve unmerged.
            torch.cuda.empty_cache()
        finally:
            self.merge_seconds += time.perf_counter() - t0
        self._undo()
        if len(self._refused) >= MAX_REFUSED:
            self._refused.clear()
        self._refused.add(key)
        self.refusals += 1
        return False

    def _merge(self, key: tuple[int, int]) -> bool:
        slot, _ = key
        t = self.arena.tables
        # One read of the slot's table rows (a device sync, once per merge).
        ranks, a_off, b_off, scales = (x[:, slot].cpu() for x in
                                       (t.ranks, t.a_offsets, t.b_offsets, t.scales))
        flat = t.arena
        changed = kept = 0  # elements merged, and those of them whose exact values are kept
        first = self.layers[0].base.weight
        free = free_device_bytes(first.device)
        # Each kept value costs its int32 position and its value.
        max_kept = (None if free is None else
                    int(free * MAX_FREE_MEMORY_SHARE) // (4 + first.element_size()))
        for i, lin in enumerate(self.layers):
            k = lin.base.in_features
            weight = lin.base.weight
            for m, (start, size) in zip(lin.module_ids, lin.out_slices, strict=True):
                r = int(ranks[lin.layer, m])
                if r == 0:
                    continue
                a0, b0 = int(a_off[lin.layer, m]), int(b_off[lin.layer, m])
                a = flat[a0 : a0 + r * k].view(r, k).clone()
                b = flat[b0 : b0 + size * r].view(size, r)
                scale = float(scales[lin.layer, m])
                step = size if self.fused else CHUNK_ROWS
                for c0 in range(0, size, step):
                    rows = min(step, size - c0)
                    changed += rows * k
                    budget = int(MAX_EXCEPTION_FRACTION * changed) - kept
                    if max_kept is not None:
                        budget = min(budget, max_kept - kept)
                    patch = self._merge_chunk(
                        i, weight, start + c0, a, b[c0 : c0 + rows].clone(), scale,
                        budget=budget)
                    if patch is None:
                        return False
                    self._patches.append(patch)
                    kept += patch.positions.numel()
        self.merged = key
        self.merges += 1
        self.peak_nbytes = max(self.peak_nbytes, self.nbytes)
        self.peak_exceptions = max(self.peak_exceptions, kept)
        return True

    def _merge_chunk(self, layer: int, weight: torch.Tensor, start: int, a: torch.Tensor,
                     b: torch.Tensor, scale: float, budget: int) -> _Patch | None:
        """Merge one chunk of rows and return how to restore it, or None (the rows untouched)
        when it needs more than `budget` exact values kept."""
        w = weight[start : start + b.shape[0]]
        if self.fused:
            cap = max(0, min(budget, w.numel()))
            positions, values, count = weight_merge.check_round_trip(w, a, b, scale, cap)
            n = int(count)  # a device sync
            if n > cap:
                return None
            weight_merge.merge_delta(w, a, b, scale, weight_merge.ADD)
            return _Patch(layer, start, a, b, scale, positions[:n].clone(), values[:n].clone())
        acc = wide(w.dtype)
        d = delta(a, b, scale, acc)
        merged = (w.to(acc) + d).to(w.dtype)
        inexact = _bits((merged.to(acc) - d).to(w.dtype)) != _bits(w)
        positions = inexact.view(-1).nonzero().view(-1).to(torch.int32)
        if positions.numel() > budget:
            return None
        values = w.reshape(-1)[positions.long()]
        w.copy_(merged)
        return _Patch(layer, start, a, b, scale, positions, values)

    @torch.no_grad()
    def _undo(self) -> None:
        """Put back every chunk merged so far, exactly."""
        for p in self._patches:
            w = self.layers[p.layer].base.weight[p.start : p.start + p.b.shape[0]]
            if self.fused:
                weight_merge.merge_delta(w, p.a, p.b, p.scale, weight_merge.SUBTRACT)
                w.view(-1)[p.positions.long()] = p.values
                continue
            acc = wide(w.dtype)
            back = (w.to(acc) - delta(p.a, p.b, p.scale, acc)).to(w.dtype)
            back.view(-1)[p.positions.long()] = p.values
            w.copy_(back)
        self._patches.clear()

    def unmerge(self) -> None:
        """Restore the base weights if an adapter is merged (before the model serves anything
        else, e.g. another engine built over the same model)."""
        if self.merged is not None:
            self.restore()

    def restore(self) -> None:
        """Put the base weights back as they were loaded, and adapt the wait before a merge."""
        self._undo()
        if self._checksums is not None:
            for lin, want in zip(self.layers, self._checksums, strict=True):
                if not torch.equal(_checksum(lin.base.weight), want):
                    raise RuntimeError(f"layer {lin.layer}: the sole-adapter merge's restore "
                                       "did not give the loaded weights back bit for bit")
        if self._merged_steps < self.after:
            self.after = min(2 * self.after, MAX_MERGE_AFTER)
        elif self._merged_steps >= 4 * self.after:
            self.after = max(self.after // 2, MERGE_AFTER_STEPS)
        self.merged = None
        self.restores += 1
