"""Host-side checks of a step's indices before launch (debug switch `SLORA_CHECK_INDICES=1`).

A kernel that reads or writes through a bad index (a page past the arena, a token row past the
step, a LoRA table row of another adapter) fails, much later and far from the cause, as "CUDA
error: an illegal memory access" (issue 15). With the switch on, every step is checked before
it is launched and a bad one raises `StepIndexError` naming the field; the checks copy device
buffers to the host (a sync per step), so they are for diagnosis and tests only.

- `check_scheduled`: the scheduler's view (engine.step): each scheduled sequence's pages are
  in the arena, owned by it alone (not free, not an adapter's, not another sequence's), cover
  its tokens; its adapter slot is its adapter's, whose table rows point into that adapter's
  pages.
- `check_context`: what the kernels of one forward will read (eager step, graph warm-up,
  graph replay): every token, sequence, page, segment and tile index in range of the step's
  `num_tokens` rows and the arena, padding included.
"""

from __future__ import annotations

import os
from collections.abc import Iterable

import numpy as np
import torch

from slora_core.arena import PageArena
from slora_core.config import LORA_MODULES
from slora_core.context import StepContext
from slora_core.page_pool import PagePool
from slora_core.scheduler import ScheduledSeq
from slora_kernels.lora_meta import ROW_BLOCK_M

ENABLED = os.environ.get("SLORA_CHECK_INDICES", "") not in ("", "0")


class StepIndexError(AssertionError):
    """A step's inputs index outside what they may touch (see module docstring)."""


def _fail(where: str, msg: str) -> None:
    raise StepIndexError(f"{where}: {msg}")


def _np(t: torch.Tensor) -> np.ndarray:
    return t.detach().to("cpu", torch.int64).numpy()


def _in_range(where: str, name: str, values: np.ndarray, lo: int, hi: int) -> None:
    """Every value in [lo, hi)."""
    if values.size and (values.min() < lo or values.max() >= hi):
        bad = values[(values < lo) | (values >= hi)]
        _fail(where, f"{name} has {bad.size} value(s) outside [{lo}, {hi}), e.g. {bad[:4]}")


# ---- the scheduler's view ----------------------------------------------------------------------
def check_scheduled(scheduled: list[ScheduledSeq], pool: PagePool, arena: PageArena) -> None:
    """Page ownership and adapter slots of a scheduled step (see module docstring)."""
    where = "scheduled step"
    free = set(pool._free)
    if len(free) != len(pool._free):
        _fail(where, "the free list holds a page twice")
    adapter_pages: dict[int, object] = {}
    for key in pool.resident_keys():
        rec = pool.resident(key)
        assert rec is not None
        for p in rec.pages:
            if p in adapter_pages or p in free:
                _fail(where, f"page {p} of adapter {key!r} is also free or another adapter's")
            adapter_pages[p] = key
    owner: dict[int, str] = {}
    slot_pages: dict[int, set[int]] = {}
    bs = arena.block_size
    for item in scheduled:
        seq = item.seq
        table = np.asarray(seq.block_table, dtype=np.int64)
        _in_range(where, f"block table of {seq.request_id}", table, 0, arena.num_pages)
        for p in seq.block_table:
            # A cached prefix page is shared by the sequences that reuse it (read only), never
            # cold (held by no one) while a scheduled sequence reads it.
            shared = p in owner and p in pool._hash_of
            if p in free or p in adapter_pages or p in pool._cold or (p in owner and not shared):
                other = ("free" if p in free else f"adapter {adapter_pages[p]!r}"
                         if p in adapter_pages else "cold (cached, held by no one)"
                         if p in pool._cold else f"request {owner[p]}")
                _fail(where, f"page {p} of request {seq.request_id} is {other}")
            owner[p] = seq.request_id
        end = seq.num_computed_tokens + item.num_new_tokens
        if end > len(seq.block_table) * bs or end > seq.num_tokens:
            _fail(where, f"request {seq.request_id} computes to token {end} with "
                  f"{len(seq.block_table)} pages of {bs} and {seq.num_tokens} tokens")
        _check_slot(where, item, pool, slot_pages)
    check_slot_rows(arena, slot_pages, where=where)


def _check_slot(where: str, item: ScheduledSeq, pool: PagePool,
                slot_pages: dict[int, set[int]]) -> None:
    """The item's slot is its adapter's, resident and referenced; records its pages."""
    seq = item.seq
    if seq.adapter is None:
        if item.adapter_slot != -1:
            _fail(where, f"base-model request {seq.request_id} has slot {item.adapter_slot}")
        return
    rec = pool.resident(seq.adapter)
    if rec is None or rec.refcount <= 0:
        _fail(where, f"request {seq.request_id}: adapter {seq.adapter!r} is not resident "
              "and referenced")
    assert rec is not None
    if item.adapter_slot != rec.slot:
        _fail(where, f"request {seq.request_id} reads slot {item.adapter_slot}, its adapter "
              f"{seq.adapter!r} is in slot {rec.slot}")
    slot_pages[rec.slot] = set(rec.pages)


def check_slot_rows(arena: PageArena, slots: Iterable[int] | dict[int, set[int]],
                    where: str = "LoRA tables") -> None:
    """Each non-empty (layer, module) row of these slots: rank within max_rank, its A and B
    matrices inside one page of the arena; and, when `slots` maps each slot to its adapter's
    pages, inside those pages."""
    owned = slots if isinstance(slots, dict) else None
    slots = sorted({int(s) for s in slots})
    if not slots:
        return
    _in_range(where, "adapter slot", np.asarray(slots), 0, arena.num_slots)
    t = arena.tables
    ranks = _np(t.ranks[:, slots])  # [L, S, M]
    a_off, b_off = _np(t.a_offsets[:, slots]), _np(t.b_offsets[:, slots])
    if t.max_rank and ranks.size and ranks.max() > t.max_rank:
        _fail(where, f"rank {ranks.max()} above max_rank {t.max_rank}")
    pn = arena.page_numel
    owns = None  # [S, num_pages]: slot i's adapter owns the page
    if owned is not None:
        owns = np.zeros((len(slots), arena.num_pages), dtype=bool)
        for i, slot in enumerate(slots):
            owns[i, sorted(owned[slot])] = True
    for m, module in enumerate(LORA_MODULES):
        fan_in, fan_out = arena.config.module_shape(module)
        live = ranks[:, :, m] > 0
        for name, off, size in (("A", a_off[:, :, m], ranks[:, :, m] * fan_in),
                                ("B", b_off[:, :, m], ranks[:, :, m] * fan_out)):
            start, last = off[live], off[live] + size[live] - 1
            _in_range(where, f"{module} {name} offsets", start, 0, arena.num_pages * pn)
            if (start // pn != last // pn).any():
                _fail(where, f"a {module} {name} matrix crosses a page boundary")
            if owns is not None:
                _, col = np.nonzero(live)  # row-major, the order of off[live]
                foreign = ~owns[col, start // pn]
                if foreign.any():
                    i = int(col[foreign][0])
                    _fail(where, f"slot {slots[i]}: {module} {name} reads page "
                          f"{int((start // pn)[foreign][0])}, which its adapter does not own")


# ---- what the kernels read ---------------------------------------------------------------------
def check_context(ctx: StepContext, num_tokens: int, arena: PageArena,
                  where: str = "step") -> None:
    """Every index `ctx` holds, for a forward over `num_tokens` token rows (see module
    docstring)."""
    bs, pages = arena.block_size, arena.num_pages
    _in_range(where, "positions", _np(ctx.positions), 0, 1 << 31)
    if ctx.positions.shape[0] != num_tokens or ctx.slot_mapping.shape[0] != num_tokens:
        _fail(where, f"positions/slot_mapping of {ctx.positions.shape[0]}/"
              f"{ctx.slot_mapping.shape[0]} rows for {num_tokens} tokens")
    _in_range(where, "slot_mapping", _np(ctx.slot_mapping), -1, pages * bs)
    tables = _np(ctx.block_tables)
    _in_range(where, "block_tables", tables, 0, pages)
    seq_lens, starts = _np(ctx.seq_lens), _np(ctx.query_starts)
    _in_range(where, "seq_lens", seq_lens, 0, tables.shape[1] * bs + 1)
    if starts.size != seq_lens.size + 1:
        _fail(where, f"{starts.size} query starts for {seq_lens.size} sequences")
    _in_range(where, "query_starts", starts, 0, num_tokens + 1)
    q_lens = np.diff(starts)
    if (q_lens < 0).any():
        _fail(where, "query_starts decrease")
    if (q_lens > seq_lens).any():
        _fail(where, "a sequence has more queries than context")
    if q_lens.size and q_lens.max() > ctx.max_query_len:
        _fail(where, f"a sequence has {q_lens.max()} queries, max_query_len is "
              f"{ctx.max_query_len}")
    _in_range(where, "logits_indices", _np(ctx.logits_indices), 0, num_tokens)
    if ctx.lora is not None and ctx.lora_tables is not None:
        _check_lora(ctx, num_tokens, arena, where)


def _check_lora(ctx: StepContext, num_tokens: int, arena: PageArena, where: str) -> None:
    meta = ctx.lora
    assert meta is not None
    if meta.token_slots.shape[0] != num_tokens:
        _fail(where, f"{meta.token_slots.shape[0]} token slots for {num_tokens} tokens")
    token_slots = _np(meta.token_slots)
    _in_range(where, "token_slots", token_slots, -1, arena.num_slots)
    if meta.block_m == ROW_BLOCK_M:  # the row kernels read each token's slot, no tile list
        check_slot_rows(arena, np.unique(token_slots[token_slots >= 0]).tolist(), where=where)
        return
    if meta.num_tiles > meta.tile_segs.shape[0]:
        _fail(where, f"{meta.num_tiles} tiles launched over a list of {meta.tile_segs.shape[0]}")
    segs = _np(meta.tile_segs[: meta.num_tiles])
    m0 = _np(meta.tile_m0[: meta.num_tiles])
    num_segments = min(meta.num_segments, meta.seg_starts.shape[0])
    _in_range(where, "tile_segs", segs, -1, num_segments)
    real = segs >= 0
    if not real.any():
        return
    used = np.unique(segs[real])
    starts, lens = _np(meta.seg_starts)[used], _np(meta.seg_lens)[used]
    slots = _np(meta.seg_slots)[used]
    _in_range(where, "seg_starts", starts, 0, num_tokens)
    _in_range(where, "segment ends", starts + lens, 1, num_tokens + 1)
    seg_len = dict(zip(used.tolist(), lens.tolist(), strict=True))
    tile_len = np.asarray([seg_len[s] for s in segs[real].tolist()])
    if ((m0[real] < 0) | (m0[real] >= tile_len)).any():
        _fail(where, "a tile starts outside its segment")
    check_slot_rows(arena, slots.tolist(), where=where)
