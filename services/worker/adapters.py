"""Adapter versions on a worker: what placement says to keep warm, and on-demand loading.

Tiers (DESIGN section 3): storage URI -> local disk cache -> host-memory LRU of the engine's
AdapterStore -> arena pages (the engine's scheduler). This module moves versions up to the host
tier; the engine takes them into pages when a request needs them.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Coroutine
from dataclasses import dataclass
from typing import Any

from services.common.convert import engine_adapter_name
from services.common.errors import NotFound, ServiceError
from services.common.versions import VersionKey
from services.worker.core_client import CoreClient
from services.worker.disk_cache import DiskCache, VersionSource
from services.worker.errors import to_service_error
from services.worker.metrics import WorkerMetrics
from slora.v1 import placement_pb2 as ppb
from slora_core.adapters import AdapterError

log = logging.getLogger(__name__)
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

    def __init__(self, core: CoreClient, cache: DiskCache, metrics: WorkerMetrics) -> None:
        self.core = core
        self.cache = cache
        self.metrics = metrics
        self.known: dict[VersionKey, KnownVersion] = {}
        self._registered: set[str] = set()
        self._loading: dict[VersionKey, asyncio.Task[str]] = {}
        self._prefetch_slots = asyncio.Semaphore(MAX_PARALLEL_PREFETCH)
        self._background: set[asyncio.Task[None]] = set()
        self._failed: dict[VersionKey, tuple[float, ServiceError]] = {}
        self._touching: asyncio.Task[None] | None = None

    async def ensure(self, adapter_id: str, version: str) -> str:
        """The engine name of a version, ready in host memory; fetches and registers it when it
        is cold. Raises NotFound for a version placement never announced, a ServiceError with
        `adapter_error` when its files are bad (digest mismatch, unreadable, incompatible)."""
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
        except (ServiceError, AdapterError) as exc:  # AdapterError: the disk cache's digest check
            err = to_service_error(exc)
            if err.adapter_error:
                self._failed[key] = (time.monotonic(), err)
            raise err from None
        self._failed.pop(key, None)
        return name

    async def _fetch_and_register(self, src: VersionSource) -> str:
        name = engine_adapter_name(src.adapter_id, src.version)
        path, downloaded = await asyncio.to_thread(self.cache.fetch, src)
        if downloaded:
            self.metrics.adapter_downloads.inc()
        await self.core.call("register_adapter", name, str(path), src.sha256)
        # The core parses and validates on a thread of its own, overlapping engine steps; a
        # bad adapter comes back as an adapter error and is unregistered there.
        await self.core.call("load_adapter", name)
        self._registered.add(name)
        return name

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
            except (ServiceError, OSError) as e:
                log.warning("prefetch of %s@%s failed: %s", key[0], key[1], e)

    async def _release(self, key: VersionKey) -> None:
        """Drop the host-memory copy; the registration and disk copy stay, so a request that
        still names the version reloads it instead of failing."""
        name = engine_adapter_name(*key)
        if name not in self._registered:
            return

        known = self.known.get(key)
        if known is None:
            await self.core.call("unregister_adapter", name)
            self._registered.discard(name)
            return
        # One command: between an unregister and a register a step could find the version
        # unknown and fail requests that still use it.
        path = self.cache.path_of(known.source)
        await self.core.call("release_adapter", name, str(path), known.source.sha256)

    async def refresh_pins(self) -> None:
        """Touch pinned versions in the host LRU so they stay warm (in the background: callers
        need not wait for the core)."""
        if self._touching is not None and not self._touching.done():
            return
        self._touching = asyncio.create_task(self._touch_pins())

    async def _touch_pins(self) -> None:
        pinned = [engine_adapter_name(*key) for key, kv in self.known.items()
                  if kv.residency == ppb.RESIDENCY_PIN]
        names = [n for n in pinned if n in self._registered]
        if names:
            try:
                await self.core.call("touch_adapters", names)
            except (ServiceError, OSError) as e:
                log.warning("keeping pinned versions warm failed: %s", e)

    def resident(self) -> list[VersionKey]:
        """Versions warm in host memory or arena pages, as of the core's latest report."""
        return [key_of_name(n) for n in self.core.state.warm_adapters or ()]

    def _spawn(self, coro: Coroutine[Any, Any, None]) -> None:
        task = asyncio.create_task(coro)
        self._background.add(task)
        task.add_done_callback(self._background.discard)
