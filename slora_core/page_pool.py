"""Bookkeeping of the unified page arena: one free list shared by KV blocks, cached prefix
blocks and adapter weights.

Pure Python (no torch): which pages are free, which KV pages are held and by how many
sequences (a cached prefix page is shared by every sequence that reuses it), which adapter
holds which pages in which slot and who uses it (refcounts), and what is evicted first when
KV blocks or another adapter need room. The tensor side (`slora_core.arena`) follows.

Prefix caching: a full KV page can be registered under its content hash (`register`, see
`slora_core.prefix_cache`); when its last holder lets it go (`free`) it stays cached, "cold":
a later sequence with the same prefix takes it again (`match`, `take_cached`) instead of
computing it. Cold prefix pages and idle adapters are the two kinds of evictable pages, and
one policy ranks them (GreedyDual): an entry that goes cold gets the priority clock + what
keeping one of its pages saves (`kv_page_cost`: a page of prefill recomputed; `adapter_page_cost`:
a page copied from host memory again), the lowest priority is evicted first and the clock
moves up to it. With equal costs (the default; estimated, not measured: at 7B shapes a 16-token
page of prefill is ~214 GFLOP, ~0.4 ms on an H200 at 500 TFLOP/s, and an 8 MiB page copied from
pinned host memory at ~25 GB/s ~0.3 ms) this is least recently used across both kinds. Pages a running request holds are never evicted.
"""

from __future__ import annotations

import heapq
from collections import OrderedDict
from collections.abc import Hashable
from dataclasses import dataclass, field


class OutOfPages(RuntimeError):
    """The arena cannot provide the pages asked for, even after evicting every cold page."""


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
    kv_page_cost: float = 1.0
    adapter_page_cost: float = 1.0
    _free: list[int] = field(init=False)
    _free_slots: list[int] = field(init=False)
    # Insertion order is use order (resident_keys); eviction follows the priorities.
    _adapters: OrderedDict[Hashable, ResidentAdapter] = field(init=False)
    evictions: int = field(init=False, default=0)  # adapters
    prefix_evictions: int = field(init=False, default=0)  # cold prefix pages
    # Kept up to date on every acquire/release/drop, so admission checks are O(1) with
    # thousands of resident adapters instead of a sum over all of them.
    _adapter_pages: int = field(init=False, default=0)
    _idle_pages: int = field(init=False, default=0)
    _num_idle: int = field(init=False, default=0)
    _kv_refs: dict[int, int] = field(init=False, default_factory=dict)  # held KV page -> holders
    _hash_of: dict[int, bytes] = field(init=False, default_factory=dict)  # cached page -> hash
    _page_of: dict[bytes, int] = field(init=False, default_factory=dict)
    _identity_of: dict[int, Hashable] = field(init=False, default_factory=dict)
    # Evictable entries and their (priority, tick): cold prefix pages and idle adapters, each
    # with a heap whose stale entries are skipped when popped.
    _cold: dict[int, tuple[float, int]] = field(init=False, default_factory=dict)
    _idle: dict[Hashable, tuple[float, int]] = field(init=False, default_factory=dict)
    _cold_heap: list[tuple[float, int, int]] = field(init=False, default_factory=list)
    _idle_heap: list[tuple[float, int, Hashable]] = field(init=False, default_factory=list)
    _clock: float = field(init=False, default=0.0)
    _tick: int = field(init=False, default=0)

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
    def num_cached_pages(self) -> int:
        """Cold prefix pages: cached, held by no sequence, evictable."""
        return len(self._cold)

    @property
    def num_kv_pages(self) -> int:
        """KV pages held by sequences (cold cached pages not counted)."""
        return self.num_pages - self.num_free - self.num_adapter_pages - self.num_cached_pages

    def idle_adapter_pages(self) -> int:
        return self._idle_pages

    def num_reclaimable(self) -> int:
        """Pages obtainable now: free pages, cold prefix pages and those of idle adapters."""
        return self.num_free + len(self._cold) + self.idle_adapter_pages()

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
        """Take `num_pages` pages for KV (one holder each), evicting cold prefix pages and idle
        adapters if the free list is short. Returns the pages and the adapters evicted."""
        if not self.can_allocate(num_pages):
            raise OutOfPages(f"need {num_pages} pages, {self.num_reclaimable()} reclaimable")
        evicted = self._evict_until(num_pages)
        pages = [self._free.pop() for _ in range(num_pages)]
        for page in pages:
            self._kv_refs[page] = 1
        return pages, evicted

    def free(self, pages: list[int]) -> None:
        """Let go of KV pages: each loses a holder; one left by all goes back to the free list,
        or, if cached, stays cold. The last pages go cold first, so that a sequence's tail is
        evicted before the prefix others share."""
        for page in reversed(pages):
            refs = self._kv_refs.get(page, 1) - 1
            if refs > 0:
                self._kv_refs[page] = refs
                continue
            self._kv_refs.pop(page, None)
            if page in self._hash_of:
                self._cold[page] = entry = self._next_priority(self.kv_page_cost)
                heapq.heappush(self._cold_heap, (*entry, page))
            else:
                self._free.append(page)

    # ---- prefix cache --------------------------------------------------------------------
    def register(self, page: int, block_hash: bytes, identity: Hashable) -> None:
        """A held, full KV page's content is `block_hash` (computed by `identity`): later
        sequences may reuse it. A hash already cached elsewhere keeps its page."""
        if page in self._hash_of or block_hash in self._page_of or page not in self._kv_refs:
            return
        self._hash_of[page] = block_hash
        self._page_of[block_hash] = page
        self._identity_of[page] = identity

    def match(self, hashes: list[bytes]) -> list[int]:
        """The pages of the longest cached run of `hashes` from the first (held or cold)."""
        pages = []
        for h in hashes:
            page = self._page_of.get(h)
            if page is None:
                break
            pages.append(page)
        return pages

    def num_cold(self, pages: list[int]) -> int:
        """How many of `pages` are cold (taking them uses up reclaimable pages)."""
        return sum(1 for p in pages if p in self._cold)

    def take_cached(self, pages: list[int]) -> None:
        """One more holder for each of `pages` (from `match`): cold ones are no longer
        evictable."""
        for page in pages:
            if page in self._cold:
                del self._cold[page]
                self._kv_refs[page] = 1
            else:
                self._kv_refs[page] += 1

    def forget_identity(self, identity: Hashable) -> int:
        """Content no one may reuse (an adapter no name serves any more): its pages are no
        longer cached; cold ones go back to the free list, held ones when let go. Returns
        how many were dropped."""
        pages = [p for p, who in self._identity_of.items() if who == identity]
        for page in pages:
            self._uncache(page)
            if self._cold.pop(page, None) is not None:
                self._free.append(page)
        return len(pages)

    def _uncache(self, page: int) -> None:
        del self._page_of[self._hash_of.pop(page)]
        del self._identity_of[page]

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
                del self._idle[key]
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
            self._idle[key] = entry = self._next_priority(self.adapter_page_cost)
            heapq.heappush(self._idle_heap, (*entry, key))

    def evict_adapter(self, key: Hashable) -> ResidentAdapter:
        """Drop an idle adapter now (e.g. a version was released by placement)."""
        rec = self._adapters[key]
        if rec.refcount:
            raise RuntimeError(f"adapter {key!r} is in use by {rec.refcount} request(s)")
        return self._drop(key)

    # ---- internals -----------------------------------------------------------------------
    def _next_priority(self, cost: float) -> tuple[float, int]:
        self._tick += 1
        return self._clock + cost, self._tick

    def _idle_pages_of(self, key: Hashable) -> int:
        rec = self._adapters.get(key)
        return len(rec.pages) if rec is not None and rec.refcount == 0 else 0

    def _top(self, heap: list, live: dict) -> tuple[float, int] | None:  # type: ignore[type-arg]
        """The heap's lowest live (priority, tick), stale entries dropped on the way."""
        while heap:
            prio, tick, item = heap[0]
            if live.get(item) == (prio, tick):
                return prio, tick
            heapq.heappop(heap)
        return None

    def _evict_until(self, num_pages: int, need_slot: bool = False) -> list[ResidentAdapter]:
        evicted: list[ResidentAdapter] = []
        while len(self._free) < num_pages or (need_slot and not self._free_slots):
            page_top = None if need_slot and not self._free_slots else self._top(
                self._cold_heap, self._cold)
            adapter_top = self._top(self._idle_heap, self._idle)
            if adapter_top is not None and (page_top is None or adapter_top < page_top):
                self._clock = max(self._clock, adapter_top[0])
                key = heapq.heappop(self._idle_heap)[2]
                evicted.append(self._drop(key))
            elif page_top is not None:
                self._clock = max(self._clock, page_top[0])
                page = heapq.heappop(self._cold_heap)[2]
                del self._cold[page]
                self._uncache(page)
                self._free.append(page)
                self.prefix_evictions += 1
            else:
                raise OutOfPages("no cold page or idle adapter left to evict")
        return evicted

    def _drop(self, key: Hashable) -> ResidentAdapter:
        """Only idle adapters are dropped (callers check)."""
        rec = self._adapters.pop(key)
        self._idle.pop(key, None)
        self._adapter_pages -= len(rec.pages)
        self._idle_pages -= len(rec.pages)
        self._num_idle -= 1
        self._free.extend(reversed(rec.pages))
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
