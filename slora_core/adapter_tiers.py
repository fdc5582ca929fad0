"""An engine's adapters through their tiers: registration (a name -> files or weights in
memory), the host tier (`AdapterStore`), reads from disk off the step loop for requests that
found their adapter in no tier, and copies into arena pages as the scheduler places them."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Mapping
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from pathlib import Path
from typing import Any, Protocol

import torch

from slora_core.adapter_cache import AdapterStore, HostAdapter, UnknownAdapterError
from slora_core.adapter_copies import AdapterCopier
from slora_core.adapters import AdapterError, LoraAdapter
from slora_core.adapters.files import adapter_files_from_tensors
from slora_core.adapters.loader import parse_adapter
from slora_core.arena import PageArena
from slora_core.outputs import RequestOutput
from slora_core.page_pool import PagePool
from slora_core.prefix_cache import lora_identity
from slora_core.scheduler import SchedulerOutput
from slora_core.stats import EngineStats

# Threads reading adapters from disk for waiting requests; how long an idle step waits for one.
DISK_LOAD_THREADS = 2
IDLE_WAIT_S = 0.01


def unloadable(name: str | None, error: object) -> str:
    return f"adapter {name!r} could not be loaded: {error}"


class ArenaListener(Protocol):
    """Told of every arena change a step makes (a tensor-parallel engine repeats them on its
    other ranks): `changing()` is held while they are made and `changed` is called."""

    def changing(self) -> contextlib.AbstractContextManager[object]: ...

    def changed(self, sched: SchedulerOutput) -> None: ...

    def forgot(self, digest: str) -> None: ...


class AdapterTiers:
    """Adapters are keyed by content digest from the registration on (the page pool's adapter
    key, a sequence's `adapter`); a name only picks the digest when a request is queued."""

    def __init__(self, store: AdapterStore, pool: PagePool, arena: PageArena,
                 stats: EngineStats, listener: ArenaListener | None = None,
                 in_use: Callable[[str], bool] = lambda digest: False) -> None:
        self.store = store
        self.pool = pool
        self.arena = arena
        self.stats = stats
        self.listener = listener
        self.in_use = in_use  # a live request reads this content
        self.copier = AdapterCopier(arena)
        # Adapters being read from disk for waiting requests, off the step loop (a read of a
        # 7B-shape adapter takes 0.1-1.2 s: on the loop it stalled every running request).
        self._reads: dict[str, Future[HostAdapter]] = {}  # by digest
        self._reader: ThreadPoolExecutor | None = None
        # Content no name serves that live requests still read: forgotten once they end.
        self._orphans: set[str] = set()

    # ---- registration --------------------------------------------------------------------
    def register(self, name: str, path: str | Path, sha256: str | None, preload: bool) -> str:
        """Name the adapter in `path` (see AdapterStore.register); with `preload`, read and
        check it now, and on any error forget the name (nothing is kept under it)."""
        old = self.store.digest_of(name) if self.store.is_registered(name) else None
        digest = self.store.register(name, path, sha256)
        if preload:
            try:
                self.store.get(name)
            except AdapterError:
                self.store.unregister(name)
                self.forget_unused(digest)
                if old is not None:
                    self.forget_unused(old)
                raise
        if old is not None and old != digest:
            self.forget_unused(old)
        return digest

    def add(self, name: str, adapter: LoraAdapter) -> str:
        old = self.store.digest_of(name) if self.store.is_registered(name) else None
        digest = self.store.add_loaded(name, adapter)
        if old is not None and old != digest:
            self.forget_unused(old)
        return digest

    def parse_tensors(self, name: str, state_dict: Mapping[str, torch.Tensor],
                      config: Mapping[str, Any] | Any, sha256: str | None) -> LoraAdapter:
        """A PEFT state dict and config parsed and checked as files would be (digest given
        and checked, or computed)."""
        files = adapter_files_from_tensors(state_dict, config, name)
        return parse_adapter(files, self.store.model_config, max_rank=self.store.max_rank,
                             dtype=self.store.dtype, expected_sha256=sha256)

    def unregister(self, name: str) -> None:
        old = self.store.unregister(name)
        if old is not None:
            self.forget_unused(old)

    def forget_unused(self, digest: str) -> None:
        """Content no name serves and no live request reads: its host copy goes, and its
        arena pages if idle (requests running on it keep theirs until they finish, and it is
        forgotten at the first step after the last one ends: `sweep`)."""
        self._orphans.discard(digest)
        if digest in self.store.names_digests():
            return
        if self.in_use(digest):
            self._orphans.add(digest)
            return
        self.store.forget(digest)
        self.pool.forget_identity(lora_identity(digest))  # its cached KV: never read again
        if self.listener is not None:
            self.listener.forgot(digest)
        rec = self.pool.resident(digest)
        if rec is None or rec.refcount:
            return
        with self.listener.changing() if self.listener else contextlib.nullcontext():
            self.copier.clear(self.pool.evict_adapter(digest).slot)
            if self.listener is not None:
                self.listener.changed(SchedulerOutput(evicted=[rec]))

    def sweep(self) -> None:
        """Forget orphaned content (see forget_unused) no live request reads any more."""
        for digest in list(self._orphans):
            self.forget_unused(digest)

    def warm(self) -> list[str]:
        """Registered adapters held in host memory or in arena pages."""
        return [n for n in self.store.names()
                if self.store.is_cached(n) or self.pool.is_resident(self.store.digest_of(n))]

    def resolve(self, name: str) -> tuple[str, HostAdapter | None, int]:
        """The digest a name serves now, its host copy if in memory (checked against the
        name's files), and the arena pages it takes (0 if not yet known). Raises
        UnknownAdapterError."""
        digest = self.store.digest_of(name)
        host = self.store.peek(name)
        return digest, host, host.layout.num_pages if host is not None else 0

    # ---- reads off the step loop ---------------------------------------------------------
    @property
    def reading(self) -> bool:
        return bool(self._reads)

    def start_read(self, name: str, digest: str) -> None:
        if digest in self._reads:
            return
        if self._reader is None:
            self._reader = ThreadPoolExecutor(DISK_LOAD_THREADS, thread_name_prefix="adapter-disk")
        self._reads[digest] = self._reader.submit(self.store.get_for, name, digest)

    def wait_for_read(self) -> None:
        """Wait briefly for a read to land (an idle step, instead of spinning)."""
        wait(list(self._reads.values()), timeout=IDLE_WAIT_S, return_when=FIRST_COMPLETED)

    def finished_reads(self) -> list[tuple[str, HostAdapter | Exception]]:
        """Reads done since the last call, by digest: the adapter, or why it could not be
        read."""
        done: list[tuple[str, HostAdapter | Exception]] = []
        for digest, future in list(self._reads.items()):
            if not future.done():
                continue
            del self._reads[digest]
            try:
                done.append((digest, future.result()))
                self.stats.adapter_background_reads += 1
            except Exception as e:  # noqa: BLE001 - any failure ends the requests, with it
                done.append((digest, e))
        return done

    def close(self) -> None:
        if self._reader is not None:
            self._reader.shutdown(wait=False, cancel_futures=True)

    # ---- arena pages ---------------------------------------------------------------------
    def apply(self, sched: SchedulerOutput,
              fail: Callable[[str, str], list[RequestOutput]]) -> list[RequestOutput]:
        """Make the arena follow the scheduler: clear evicted slots, copy newly placed
        adapters in. An adapter that can no longer be loaded is `fail`ed (its requests end,
        they leave `sched`) and dropped from the arena; the others go on."""
        if self.listener is None:
            return self._apply(sched, fail)
        with self.listener.changing():
            failed = self._apply(sched, fail)
            self.listener.changed(sched)
            return failed

    def _apply(self, sched: SchedulerOutput,
               fail: Callable[[str, str], list[RequestOutput]]) -> list[RequestOutput]:
        for rec in sched.evicted:
            self.copier.clear(rec.slot)
        failed: list[RequestOutput] = []
        for rec in sched.new_adapters:
            digest = str(rec.key)
            disk_reads = self.store.loads
            try:
                host = self.store.get_digest(digest)
            except (AdapterError, UnknownAdapterError) as e:
                failed += fail(digest, str(e))
                if self.pool.is_resident(digest):
                    self.arena.clear_slot(self.pool.evict_adapter(digest).slot)
                continue
            self.copier.write(rec.slot, rec.pages, host)
            self.stats.adapter_loads += 1
            if self.store.loads > disk_reads:
                self.stats.adapter_disk_loads += 1
            else:
                self.stats.adapter_host_hits += 1
        return failed

    def wait_for_copies(self, sched: SchedulerOutput) -> None:
        """Make the compute stream wait for the adapter copies this step reads."""
        if not self.copier.has_pending:
            return
        for item in sched.scheduled:
            if item.adapter_slot >= 0:
                self.copier.wait(item.adapter_slot)
