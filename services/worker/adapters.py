"""Adapter versions on a worker: what placement says to keep warm, and on-demand loading.

Tiers (DESIGN section 3): storage URI -> local disk cache -> host-memory LRU of the engine's
AdapterStore -> arena pages (the engine's scheduler). This module moves versions up to the host
tier; the engine takes them into pages when a request needs them.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Coroutine
from dataclasses import dataclass
from typing import Any, TypeVar

from services.common.convert import engine_adapter_name
from services.common.errors import NotFound
from services.worker.disk_cache import DiskCache, VersionSource
from services.worker.engine_loop import EngineLoop
from services.worker.metrics import VersionKey
from slora.v1 import placement_pb2 as ppb
from slora_core.adapters import AdapterError
from slora_core.engine import LLMEngine

log = logging.getLogger(__name__)
T = TypeVar("T")
WARM = (ppb.RESIDENCY_PREFETCH, ppb.RESIDENCY_PIN)
# Prefetches run at most this many at a time, so placement never starves on-demand loads.
MAX_PARALLEL_PREFETCH = 2
# A version whose files failed (digest mismatch, unreadable, incompatible) is refused at once for
# this long instead of being fetched again by every request; then one request tries again.
FAILED_RETRY_S = 30.0


@dataclass
class KnownVersion:
    source: VersionSource
    residency: int


def key_of_name(name: str) -> VersionKey:
    adapter_id, _, version = name.rpartition("@")
    return adapter_id, version


class AdapterManager:
    """The versions this worker may serve (from placement) and their load state."""

    def __init__(self, engine_loop: EngineLoop, cache: DiskCache) -> None:
        self.engine_loop = engine_loop
        self.cache = cache
        self.known: dict[VersionKey, KnownVersion] = {}
        self._registered: set[str] = set()
        self._loading: dict[VersionKey, asyncio.Task[str]] = {}
        self._prefetch_slots = asyncio.Semaphore(MAX_PARALLEL_PREFETCH)
        self._background: set[asyncio.Task[None]] = set()
        self._failed: dict[VersionKey, tuple[float, AdapterError]] = {}

    async def ensure(self, adapter_id: str, version: str) -> str:
        """The engine name of a version, ready in host memory; fetches and registers it when it
        is cold. Raises NotFound for a version placement never announced, AdapterError when
        its files are bad (digest mismatch, unreadable, incompatible)."""
        key = (adapter_id, version)
        if key not in self.known:
            raise NotFound(f"adapter {adapter_id!r} version {version!r} is not known here")
        name = engine_adapter_name(adapter_id, version)
        if name in self._registered:
            return name
        failed = self._failed.get(key)
        if failed is not None and time.monotonic() - failed[0] < FAILED_RETRY_S:
            raise failed[1]
        task = self._loading.get(key)
        if task is None:
            task = asyncio.create_task(self._load(self.known[key].source))
            self._loading[key] = task
            task.add_done_callback(lambda _t: self._loading.pop(key, None))
        # shield: one caller's cancel must not cancel the load that others wait on.
        return await asyncio.shield(task)

    async def _load(self, src: VersionSource) -> str:
        key = (src.adapter_id, src.version)
        try:
            name = await self._fetch_and_register(src)
        except AdapterError as e:
            self._failed[key] = (time.monotonic(), e)
            raise
        self._failed.pop(key, None)
        return name

    async def _fetch_and_register(self, src: VersionSource) -> str:
        name = engine_adapter_name(src.adapter_id, src.version)
        path, downloaded = await asyncio.to_thread(self.cache.fetch, src)
        if downloaded:
            self.engine_loop.metrics.adapter_downloads.inc()
        await self._on_engine(lambda e: e.register_adapter(name, path, src.sha256, preload=False))
        try:
            # AdapterStore guards its LRU with a lock, so the parse and validation run here in
            # a thread and overlap engine steps instead of stalling the batch.
            await asyncio.to_thread(self.engine_loop.engine.adapters.get, name)
        except AdapterError:
            await self._on_engine(lambda e: e.adapters.unregister(name))
            raise
        self._registered.add(name)
        return name

    async def _on_engine(self, fn: Callable[[LLMEngine], T]) -> T:
        return await asyncio.wrap_future(self.engine_loop.call(fn))

    # ---- placement ----------------------------------------------------------------------
    async def apply(self, update: ppb.PlacementUpdate) -> None:
        """Apply a snapshot or delta: learn versions, warm the assigned ones, release others."""
        incoming = {(p.adapter_id, p.version): p for p in update.upserts}
        gone = [(r.adapter_id, r.version) for r in update.removals]
        if update.snapshot:
            gone += [k for k in self.known if k not in incoming]
        for key in gone:
            old = self.known.pop(key, None)
            if old is not None and old.residency in WARM:
                await self._release(key)
        for key, p in incoming.items():
            src = VersionSource(p.adapter_id, p.version, p.storage_uri, p.sha256)
            old = self.known.get(key)
            if old is not None and old.source != src:
                self._failed.pop(key, None)  # new files: worth a fresh try
            self.known[key] = KnownVersion(src, p.residency)
            if p.residency in WARM and (old is None or old.residency not in WARM):
                self._spawn(self._prefetch(key))
            elif p.residency not in WARM and old is not None and old.residency in WARM:
                await self._release(key)

    async def _prefetch(self, key: VersionKey) -> None:
        async with self._prefetch_slots:
            try:
                await self.ensure(*key)
            except (AdapterError, NotFound, OSError) as e:
                log.warning("prefetch of %s@%s failed: %s", key[0], key[1], e)

    async def _release(self, key: VersionKey) -> None:
        """Drop the host-memory copy; the registration and disk copy stay, so a request that
        still names the version reloads it instead of failing."""
        name = engine_adapter_name(*key)
        if name not in self._registered:
            return

        known = self.known.get(key)
        path = self.cache.path_of(known.source) if known is not None else None

        def drop(e: LLMEngine) -> None:
            e.adapters.unregister(name)
            if known is not None and path is not None:
                e.register_adapter(name, path, known.source.sha256, preload=False)

        await self._on_engine(drop)
        if key not in self.known:
            self._registered.discard(name)

    async def refresh_pins(self) -> None:
        """Touch pinned versions in the host LRU so they stay warm."""
        for key, kv in list(self.known.items()):
            name = engine_adapter_name(*key)
            if kv.residency == ppb.RESIDENCY_PIN and name in self._registered:
                await asyncio.to_thread(self.engine_loop.engine.adapters.get, name)

    async def resident(self) -> list[VersionKey]:
        """Versions warm in host memory or arena pages."""
        def warm(e: LLMEngine) -> list[str]:
            return [n for n in e.adapters.names() if e.adapters.is_cached(n) or e.pool.is_resident(n)]

        names = await self._on_engine(warm)
        return [key_of_name(n) for n in names]

    def _spawn(self, coro: Coroutine[Any, Any, None]) -> None:
        task = asyncio.create_task(coro)
        self._background.add(task)
        task.add_done_callback(self._background.discard)
