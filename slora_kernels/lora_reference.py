"""Torch reference for the segmented multi-LoRA delta read from the page arena.

Semantics, for every segment s (the tokens that share one adapter slot: a run of token rows,
or of `meta.token_rows` when the tokens are not grouped by adapter) and every module m
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

import torch

from slora_kernels.lora_meta import LoraMeta


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
    """y += the multi-LoRA delta of x (see module docstring). Computes in float32 (float64
    given float64 inputs) and rounds y + delta to y's dtype once, in peft's order for 16-bit
    models (peft keeps the adapter in float32, adds the float32 delta to the 16-bit base
    output and casts the sum back) and as the Triton expand does; rounding the delta to 16
    bits before the add would round twice."""
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
    rows = torch.arange(x.shape[0], device=x.device) if meta.token_rows is None else (
        meta.token_rows.to(device=x.device, dtype=torch.long))
    for start, n, slot in zip(starts, lens, slots, strict=True):
        acc = torch.promote_types(x.dtype, torch.float32)
        seg_rows = rows[start : start + n]
        xs = x[seg_rows].to(acc)
        for m, (o_start, o_size) in zip(module_ids, out_slices, strict=True):
            r = ranks_h[slot][m]
            if r == 0:
                continue
            a = arena[a_off[slot][m] : a_off[slot][m] + r * k].view(r, k).to(acc)
            b = arena[b_off[slot][m] : b_off[slot][m] + o_size * r].view(o_size, r).to(acc)
            delta = (xs @ a.T) @ b.T * scales_h[slot][m]
            cols = slice(o_start, o_start + o_size)
            y[seg_rows, cols] = (y[seg_rows, cols].to(acc) + delta).to(y.dtype)
