"""Bookkeeping of the unified page arena: one free list shared by KV blocks and adapter weights.

Pure Python (no torch): which pages are free, which adapter holds which pages in which slot, who
uses each resident adapter (refcounts), and which idle adapter is evicted first (LRU) when KV
blocks or another adapter need room. The tensor side (`slora_core.arena`) follows its decisions.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Hashable
from dataclasses import dataclass, field


class OutOfPages(RuntimeError):
    """The arena cannot provide the pages asked for, even after evicting every idle adapter."""


@dataclass
class ResidentAdapter:
    key: Hashable
    slot: int
    pages: list[int]
    refcount: int = 0


@dataclass
class PagePool:
    """Free list of `num_pages` pages plus resident-adapter records in `num_slots` slots."""

    num_pages: int
    num_slots: int
    _free: list[int] = field(init=False)
    _free_slots: list[int] = field(init=False)
    # Insertion order is LRU order: the first idle entry is evicted first.
    _adapters: OrderedDict[Hashable, ResidentAdapter] = field(init=False)
    evictions: int = field(init=False, default=0)
    # Kept up to date on every acquire/release/drop, so admission checks are O(1) with
    # thousands of resident adapters instead of a sum over all of them.
    _adapter_pages: int = field(init=False, default=0)
    _idle_pages: int = field(init=False, default=0)
    _num_idle: int = field(init=False, default=0)

    def __post_init__(self) -> None:
        if self.num_pages <= 0 or self.num_slots <= 0:
            raise ValueError("num_pages and num_slots must be positive")
        # Pop from the end: hand out low page numbers first (easier to read in tests and dumps).
        self._free = list(range(self.num_pages - 1, -1, -1))
        self._free_slots = list(range(self.num_slots - 1, -1, -1))
        self._adapters = OrderedDict()

    # ---- queries -------------------------------------------------------------------------
    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_adapter_pages(self) -> int:
        return self._adapter_pages

    @property
    def num_kv_pages(self) -> int:
        return self.num_pages - self.num_free - self.num_adapter_pages

    def idle_adapter_pages(self) -> int:
        return self._idle_pages

    def num_reclaimable(self) -> int:
        """Pages obtainable now: free pages plus those of idle adapters."""
        return self.num_free + self.idle_adapter_pages()

    def is_resident(self, key: Hashable) -> bool:
        return key in self._adapters

    def resident(self, key: Hashable) -> ResidentAdapter | None:
        return self._adapters.get(key)

    def resident_keys(self) -> list[Hashable]:
        return list(self._adapters)

    def has_free_slot(self) -> bool:
        return bool(self._free_slots)

    def can_allocate(self, num_pages: int) -> bool:
        return num_pages <= self.num_reclaimable()

    def can_admit_adapter(self, key: Hashable, num_pages: int, extra_pages: int = 0) -> bool:
        """True if `key` is resident or could be made resident with `extra_pages` to spare."""
        if key in self._adapters:
            return extra_pages <= self.num_reclaimable() - self._idle_pages_of(key)
        has_slot = bool(self._free_slots) or self._num_idle > 0
        return has_slot and num_pages + extra_pages <= self.num_reclaimable()

    # ---- KV blocks -----------------------------------------------------------------------
    def allocate(self, num_pages: int) -> tuple[list[int], list[ResidentAdapter]]:
        """Take `num_pages` pages for KV, evicting idle adapters (LRU) if the free list is short.
        Returns the pages and the adapters evicted to make room."""
        if not self.can_allocate(num_pages):
            raise OutOfPages(f"need {num_pages} pages, {self.num_reclaimable()} reclaimable")
        evicted = self._evict_until(num_pages)
        return [self._free.pop() for _ in range(num_pages)], evicted

    def free(self, pages: list[int]) -> None:
        self._free.extend(reversed(pages))

    # ---- adapters ------------------------------------------------------------------------
    def acquire_adapter(
        self, key: Hashable, num_pages: int
    ) -> tuple[ResidentAdapter, bool, list[ResidentAdapter]]:
        """Make `key` resident (if needed) and take a reference on it.

        Returns (record, newly_resident, evicted). A newly resident adapter's pages must be filled
        by the caller before the next forward pass."""
        rec = self._adapters.get(key)
        if rec is not None:
            if rec.refcount == 0:
                self._idle_pages -= len(rec.pages)
                self._num_idle -= 1
            rec.refcount += 1
            self._adapters.move_to_end(key)
            return rec, False, []
        if not self.can_admit_adapter(key, num_pages):
            raise OutOfPages(f"adapter {key!r} needs {num_pages} pages and a slot")
        evicted = self._evict_until(num_pages, need_slot=True)
        pages = [self._free.pop() for _ in range(num_pages)]
        rec = ResidentAdapter(key=key, slot=self._free_slots.pop(), pages=pages, refcount=1)
        self._adapters[key] = rec
        self._adapter_pages += num_pages
        return rec, True, evicted

    def release_adapter(self, key: Hashable) -> None:
        rec = self._adapters[key]
        if rec.refcount <= 0:
            raise RuntimeError(f"adapter {key!r} released more often than acquired")
        rec.refcount -= 1
        if rec.refcount == 0:
            self._idle_pages += len(rec.pages)
            self._num_idle += 1

    def evict_adapter(self, key: Hashable) -> ResidentAdapter:
        """Drop an idle adapter now (e.g. a version was released by placement)."""
        rec = self._adapters[key]
        if rec.refcount:
            raise RuntimeError(f"adapter {key!r} is in use by {rec.refcount} request(s)")
        return self._drop(key)

    # ---- internals -----------------------------------------------------------------------
    def _idle_pages_of(self, key: Hashable) -> int:
        rec = self._adapters.get(key)
        return len(rec.pages) if rec is not None and rec.refcount == 0 else 0

    def _evict_until(self, num_pages: int, need_slot: bool = False) -> list[ResidentAdapter]:
        evicted: list[ResidentAdapter] = []
        while len(self._free) < num_pages or (need_slot and not self._free_slots):
            victim = next((k for k, a in self._adapters.items() if a.refcount == 0), None)
            if victim is None:
                raise OutOfPages("no idle adapter left to evict")
            evicted.append(self._drop(victim))
        return evicted

    def _drop(self, key: Hashable) -> ResidentAdapter:
        """Only idle adapters are dropped (callers check)."""
        rec = self._adapters.pop(key)
        self._adapter_pages -= len(rec.pages)
        self._idle_pages -= len(rec.pages)
        self._num_idle -= 1
        self.free(rec.pages)
        self._free_slots.append(rec.slot)
        self.evictions += 1
        return rec


def pack_matrices(sizes: list[int], page_numel: int) -> tuple[int, list[tuple[int, int]]]:
    """First-fit-decreasing packing of matrices (element counts) into pages of `page_numel`.

    Each matrix lies contiguous inside one page. Returns (num_pages, [(page_index, offset)]) with
    placements in the order of `sizes`."""
    order = sorted(range(len(sizes)), key=lambda i: -sizes[i])
    used: list[int] = []
    placements: list[tuple[int, int]] = [(0, 0)] * len(sizes)
    for i in order:
        size = sizes[i]
        if size > page_numel:
            raise ValueError(f"a matrix of {size} elements does not fit a page of {page_numel}")
        page = next((p for p, u in enumerate(used) if u + size <= page_numel), None)
        if page is None:
            page = len(used)
            used.append(0)
        placements[i] = (page, used[page])
        used[page] += size
    return len(used), placements
