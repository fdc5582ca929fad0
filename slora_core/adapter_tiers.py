"""An engine's adapters through their tiers: registration (a name -> files or weights in
memory), the host tier (`AdapterStore`), reads from disk off the step loop for requests that
found their adapter in no tier, and copies into arena pages as the scheduler places them."""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from pathlib import Path
from typing import Protocol

from slora_core.adapter_cache import AdapterStore, HostAdapter, UnknownAdapterError
from slora_core.adapter_copies import AdapterCopier
from slora_core.adapters import AdapterError, LoraAdapter
from slora_core.arena import PageArena
from slora_core.outputs import RequestOutput
from slora_core.page_pool import PagePool
from slora_core.scheduler import SchedulerOutput
from slora_core.stats import EngineStats

# Threads reading adapters from disk for waiting requests; how long an idle step waits for one.
DISK_LOAD_THREADS = 2
IDLE_WAIT_S = 0.01


def unloadable(name: str, error: object) -> str:
    return f"adapter {name!r} could not be loaded: {error}"


class ArenaListener(Protocol):
    """Told of every arena change a step makes (a tensor-parallel engine repeats them on its
    other ranks): `changing()` is held while they are made and `changed` is called."""

    def changing(self) -> contextlib.AbstractContextManager[object]: ...

    def changed(self, sched: SchedulerOutput) -> None: ...


class AdapterTiers:
    def __init__(self, store: AdapterStore, pool: PagePool, arena: PageArena,
                 stats: EngineStats, listener: ArenaListener | None = None) -> None:
        self.store = store
        self.pool = pool
        self.arena = arena
        self.stats = stats
        self.listener = listener
        self.copier = AdapterCopier(arena)
        # Adapters being read from disk for waiting requests, off the step loop (a read of a
        # 7B-shape adapter takes 0.1-1.2 s: on the loop it stalled every running request).
        self._reads: dict[str, Future[HostAdapter]] = {}
        self._reader: ThreadPoolExecutor | None = None

    # ---- registration --------------------------------------------------------------------
    def register(self, name: str, path: str | Path, sha256: str | None, preload: bool) -> None:
        self.store.register(name, path, sha256)
        if preload:
            try:
                self.store.get(name)
            except AdapterError:
                self.store.unregister(name)
                raise

    def warm(self) -> list[str]:
        """Registered adapters held in host memory or in arena pages."""
        return [n for n in self.store.names()
                if self.store.is_cached(n) or self.pool.is_resident(n)]

    def host_pages(self, name: str) -> tuple[HostAdapter | None, int]:
        """The adapter if it is in host memory, and the arena pages it takes (0 if not yet
        known). Raises UnknownAdapterError."""
        if not self.store.is_registered(name):
            raise UnknownAdapterError(name)
        host = self.store.peek(name)
        return host, host.layout.num_pages if host is not None else 0

    def add(self, name: str, adapter: LoraAdapter) -> None:
        self.store.add_loaded(name, adapter)

    # ---- reads off the step loop ---------------------------------------------------------
    @property
    def reading(self) -> bool:
        return bool(self._reads)

    def start_read(self, name: str) -> None:
        if name in self._reads:
            return
        if self._reader is None:
            self._reader = ThreadPoolExecutor(DISK_LOAD_THREADS, thread_name_prefix="adapter-disk")
        self._reads[name] = self._reader.submit(self.store.get, name)

    def wait_for_read(self) -> None:
        """Wait briefly for a read to land (an idle step, instead of spinning)."""
        wait(list(self._reads.values()), timeout=IDLE_WAIT_S, return_when=FIRST_COMPLETED)

    def finished_reads(self) -> list[tuple[str, HostAdapter | Exception]]:
        """Reads done since the last call: the adapter, or why it could not be read."""
        done: list[tuple[str, HostAdapter | Exception]] = []
        for name, future in list(self._reads.items()):
            if not future.done():
                continue
            del self._reads[name]
            try:
                done.append((name, future.result()))
                self.stats.adapter_background_reads += 1
            except Exception as e:  # noqa: BLE001 - any failure ends the requests, with it
                done.append((name, e))
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
            name = str(rec.key)
            disk_reads = self.store.loads
            try:
                host = self.store.get(name)
            except (AdapterError, UnknownAdapterError) as e:
                failed += fail(name, str(e))
                if self.pool.is_resident(name):
                    self.arena.clear_slot(self.pool.evict_adapter(name).slot)
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
