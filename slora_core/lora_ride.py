"""Sole-adapter ride (EngineConfig.ride_sole_adapter): when every token of a step reads one
adapter and that adapter is not merged, its shrink rides the base projection's GEMM.

Each wrapped projection's weight is stored with room for `max_rank` more rows per module
after its own `out` rows (the Linear's weight is a view of the first `out`), and a
block-diagonal expand matrix beside it. Of that room a step reads `rows` a module: the loaded
adapter's largest rank rounded up to a power of two from 8 (SoleAdapterRide.rows_for), so a
rank-8 adapter's GEMMs read 8 more rows a module, not max_rank's 64 (`rank_sized`; the ride
graphs are captured per row count, cuda_graphs.ride_tiles, every count at start-up):

    W_ext = [W; A_0; A_1; ...]                  [out + modules * rows, in]
    B_t[m * rows + j, slice_m] = scale_m * B_m[:, j]            [modules * rows, out]

    y_ext = x @ W_ext.T            one GEMM: y = y_ext[:, :out] and x @ A.T = y_ext[:, out:]
    y    += y_ext[:, out:] @ B_t   one small launch into y's columns, in place

so a step pays one wider GEMM and one small one per projection instead of the base GEMM plus
the Triton shrink and expand (H200, one 7B decode layer, one adapter on all 7 modules:
+15.0-17.2 us against +28.8-52.3 us, lora-layer-fusion-h200.json). qkv's and gate_up's
expand is not launched at all: the projection defers it (context.defer_expand) and the op that
reads its output fuses it in (ops.rotary, ops.silu_mul; FUSED_CONSUMERS). o's and down's is a
Triton launch (slora_kernels.ride_expand; cuBLAS's addmm where Triton does not run). A module an
adapter does not target, and a rank below `rows`, leaves zero rows and columns: they add
nothing.
The projection's output is then a strided view (row stride `out + modules * rows` rounded up
to RIDE_ROW_ALIGN elements, through zero rows): every consumer (rotary, the KV write and
attention for qkv, rms_norm with the residual for o and down, silu_mul for gate_up) takes row
strides.

The appended rows follow one adapter at a time: they are loaded from the arena when the same
sole adapter (slot and slot generation) has held RIDE_AFTER_STEPS steps in a row, since a load
is ~7 small copies per projection (about 900 launches at 32 layers) while a step saves tens of
microseconds per layer. Loads are stream-ordered device copies: a step still in flight finishes
with the rows it was launched with. Decode and mixed (prefill) graphs capture a ride graph per
bucket and row count (`cuda_graphs.ride_tiles`). Steps that read several adapters, or
base-model rows beside adapter rows, run the Triton kernels as before; so does a step whose
adapter is merged (lora_merge), which runs as the base model.

The trade: modules x max_rank more weight rows and the expand matrix in device memory (at
Llama-2-7B with max_rank 64, about 0.5 GB), allocated when the engine is built, before its
arena.

Rounding: the shrink's output is rounded to the weights' dtype before the expand (as peft's
lora_B(lora_A(x)) is), and scale is folded into B (one more rounding of B), so a ride step's
result differs from the kernels' (which keep x @ A.T in float32) within the dtype's rounding.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import replace

import torch

from slora_core.arena import PageArena
from slora_core.config import MODULE_INDEX
from slora_core.lora import LoraLinear, RideRows, round_up
from slora_core.lora_merge import sole_slot
from slora_core.step_inputs import StepInputs

# Steps in a row on one sole adapter before its rows are loaded (see the docstring).
RIDE_AFTER_STEPS = 4
# The wide GEMM output's row stride a multiple of this many elements (RideRows.width): with
# rank-8 rows qkv's 12,288 + 24 columns and o's and down's 4,096 + 8 are not multiples of 16,
# and Triton specializes an integer argument (a row stride) on divisibility by 16 only, so
# every kernel reading those outputs (rotary, the KV write, attention, the residual
# rms_norm) could not prove its rows aligned and loaded them a few bytes at a time.
RIDE_ROW_ALIGN = 16


@torch.no_grad()
def attach_ride_rows(model: torch.nn.Module, max_rank: int) -> list[LoraLinear]:
    """Give every wrapped projection of `model` its appended rows and expand matrix (zeros),
    moving the base weight into the first rows of the wider one. Idempotent; returns the
    projections."""
    layers = [m for m in model.modules() if isinstance(m, LoraLinear)]
    for lin in layers:
        if lin.ride is not None and lin.ride.rank == max_rank:
            continue
        weight = lin.base.weight
        out, k = weight.shape
        extra = len(lin.module_ids) * max_rank
        wide = torch.zeros(round_up(out + extra, RIDE_ROW_ALIGN), k, dtype=weight.dtype,
                           device=weight.device)
        wide[:out].copy_(weight)
        # The Linear keeps its Parameter; its data becomes the first rows of the wide weight
        # (freeing the old storage once nothing else holds it).
        weight.data = wide[:out]
        b_t = torch.zeros(extra, out, dtype=weight.dtype, device=weight.device)
        lin.ride = RideRows(wide, b_t, out, max_rank, len(lin.module_ids),
                            defer=lin.module_ids in FUSED_CONSUMERS, align=RIDE_ROW_ALIGN)
    return layers


# Projections whose expand the op reading their output fuses in (ops.rotary for qkv,
# ops.silu_mul for gate_up); o and down keep their addmm (their consumer, the residual
# rms_norm, reduces whole rows).
FUSED_CONSUMERS = frozenset({
    tuple(MODULE_INDEX[m] for m in ("q_proj", "k_proj", "v_proj")),
    tuple(MODULE_INDEX[m] for m in ("gate_proj", "up_proj"))})


class SoleAdapterRide:
    """Owns the appended rows of one model's wrapped projections over one page arena."""

    def __init__(self, model: torch.nn.Module, arena: PageArena) -> None:
        self.arena = arena
        max_rank = arena.tables.max_rank
        if not max_rank:
            raise ValueError("the ride needs the arena's max_rank (a bound on every rank)")
        self.layers = attach_ride_rows(model, max_rank)
        if not self.layers:
            raise ValueError("no LoRA-wrapped projections to ride (wrap_lora first)")
        self.loaded: tuple[int, int] | None = None  # (slot, slot generation) in the rows now
        # Rows per module sized to the loaded adapter's rank (rows_for) rather than max_rank.
        self.rank_sized = True
        self._streak: tuple[tuple[int, int] | None, int] = (None, 0)
        self.loads = 0
        self.ride_steps = 0  # steps run riding, over the engine's life

    @property
    def fused_consumers(self) -> bool:
        """Whether qkv's and gate_up's expands are fused into rotary and silu_mul (the
        default) rather than run as addmm launches. Set it before graphs are captured: a
        captured graph keeps the launches it was captured with."""
        return any(lin.ride is not None and lin.ride.defer for lin in self.layers)

    @fused_consumers.setter
    def fused_consumers(self, on: bool) -> None:
        for lin in self.layers:
            assert lin.ride is not None
            lin.ride.defer = on and lin.module_ids in FUSED_CONSUMERS

    @property
    def triton_expands(self) -> bool:
        """Whether the expands not fused into an op (o's, down's) run as a Triton launch behind
        their GEMM (slora_kernels.ride_expand) rather than cuBLAS's addmm. On (the default):
        without PDL it beat the addmm in every shape on an H100, by 0.5-2.4 us a layer, and
        the one-adapter ride went from 0.973x to 0.977x of base in the engine, and from 0.970x
        to 0.973x in a second run (lora-layer-fusion-ops-5be1284-h100.json,
        distinct-adapters-ride-5be1284-h100.json, distinct-adapters-ride-c4cb6f6-h100.json).
        Set it before graphs are captured."""
        return any(lin.ride is not None and lin.ride.triton_expand for lin in self.layers)

    @triton_expands.setter
    def triton_expands(self, on: bool) -> None:
        for lin in self.layers:
            assert lin.ride is not None
            lin.ride.triton_expand = on

    @property
    def row_align(self) -> int:
        """The wide outputs' row stride a multiple of this many elements (RIDE_ROW_ALIGN by
        default; 1: no zero columns added). Set it before graphs are captured."""
        ride = self.layers[0].ride
        assert ride is not None
        return ride.align

    @row_align.setter
    def row_align(self, align: int) -> None:
        if align < 1:
            raise ValueError(f"row_align must be 1 or more elements, got {align}")
        rides = [lin.ride for lin in self.layers if lin.ride is not None]
        if any(r.weight.shape[0] < round_up(r.out + r.modules * r.rank, align) for r in rides):
            raise ValueError(f"row_align {align}: the wide weights were allocated for "
                             f"{RIDE_ROW_ALIGN}")
        for r in rides:  # every projection or none
            r.align = align

    @property
    def rows(self) -> int:
        """Rows per module the projections' GEMMs and expands read now (the graphs' key)."""
        ride = self.layers[0].ride
        assert ride is not None
        return ride.rows

    @property
    def row_counts(self) -> tuple[int, ...]:
        """Every `rows` a load can choose (rows_for over ranks 1..max_rank): the ride graphs
        start-up captures, so that no rank's first ride compiles or captures mid-serving."""
        max_rank = self.arena.tables.max_rank
        return tuple(sorted({self.rows_for(r) for r in range(1, max_rank + 1)}))

    @contextmanager
    def using_rows(self, rows: int) -> Iterator[None]:
        """Every projection's GEMM and expand read `rows` rows a module inside the block (a
        graph captured for that row count before any adapter of it is loaded), then the
        loaded adapter's again. Host state only: what the rows hold is not touched."""
        before = self.rows
        self._set_rows(rows)
        try:
            yield
        finally:
            self._set_rows(before)

    def _set_rows(self, rows: int) -> None:
        for lin in self.layers:
            assert lin.ride is not None
            lin.ride.rows = rows

    def rows_for(self, rank: int) -> int:
        """Rows per module for an adapter of largest rank `rank`: the power of two at or
        above it (at least 8, so few ride graphs are captured; at most max_rank), or max_rank
        when not `rank_sized`."""
        max_rank = self.arena.tables.max_rank
        if not self.rank_sized:
            return max_rank
        return min(max_rank, max(8, 1 << (max(rank, 1) - 1).bit_length()))

    @property
    def nbytes(self) -> int:
        """Device bytes the appended rows and expand matrices take."""
        return sum((lin.ride.weight.numel() - lin.base.weight.numel() + lin.ride.b_t.numel())
                   * lin.ride.b_t.element_size() for lin in self.layers if lin.ride is not None)

    def route(self, inputs: StepInputs) -> StepInputs:
        """The step as given, or marked to ride (`StepInputs.ride`) when its sole adapter's
        rows are loaded (loading them first once it has held long enough)."""
        slot = sole_slot(inputs)
        if slot is None:
            self._streak = (None, 0)
            return inputs
        key = (slot, self.arena.slot_generation[slot])
        last, n = self._streak
        n = n + 1 if key == last else 1
        self._streak = (key, n)
        if key != self.loaded:
            if n < RIDE_AFTER_STEPS:
                return inputs
            self.load(key)
        self.ride_steps += 1
        return replace(inputs, ride=True)

    @torch.no_grad()
    def load(self, key: tuple[int, int]) -> None:
        """Copy the adapter in `key`'s slot into every projection's appended rows."""
        slot, _ = key
        t = self.arena.tables
        # One read of the slot's table rows (a device sync, once per load).
        ranks, a_off, b_off, scales = (x[:, slot].cpu() for x in
                                       (t.ranks, t.a_offsets, t.b_offsets, t.scales))
        flat = t.arena
        per = self.rows_for(int(ranks.max()))  # rows a module, for every projection
        self._set_rows(per)
        for lin in self.layers:
            ride = lin.ride
            assert ride is not None
            k = lin.base.in_features
            rows = ride.weight[ride.out:]
            rows.zero_()
            ride.b_t.zero_()
            for i, (m, (start, size)) in enumerate(zip(lin.module_ids, lin.out_slices,
                                                       strict=True)):
                r = int(ranks[lin.layer, m])
                if r == 0:
                    continue
                a0, b0 = int(a_off[lin.layer, m]), int(b_off[lin.layer, m])
                rows[i * per : i * per + r].copy_(flat[a0 : a0 + r * k].view(r, k))
                block = ride.b_t[i * per : i * per + r, start : start + size]
                block.copy_(flat[b0 : b0 + size * r].view(size, r).t())
                block.mul_(float(scales[lin.layer, m]))
        self.loaded = key
        self.loads += 1
