"""The worker's adapter manager on real components (an engine-core process, disk cache): a
version whose files fail is refused at once for a while instead of fetched on every request,
and new files from placement get a fresh try."""

from __future__ import annotations

import asyncio
import shutil
from pathlib import Path

import pytest

import services.worker.adapters as adapters_mod
from services.common.errors import ServiceError
from services.worker.adapters import AdapterManager
from services.worker.core_client import CoreClient
from services.worker.disk_cache import DiskCache
from services.worker.metrics import WorkerMetrics
from slora.v1 import placement_pb2 as ppb
from slora_core.adapters import digest_adapter_dir
from slora_core.config import EngineConfig


def placement(path: Path, sha256: str) -> ppb.PlacementUpdate:
    return ppb.PlacementUpdate(upserts=[ppb.VersionPlacement(
        adapter_id="qv", version="v1", storage_uri=path.resolve().as_uri(), sha256=sha256,
        residency=ppb.RESIDENCY_ON_DEMAND)])


def test_failed_version_is_not_refetched_until_its_files_change(demo_dir, tmp_path,
                                                                  monkeypatch):
    cache = DiskCache(tmp_path / "cache")
    fetches: list[str] = []
    real_fetch = cache.fetch

    def counting_fetch(src):
        fetches.append(src.sha256)
        return real_fetch(src)

    monkeypatch.setattr(cache, "fetch", counting_fetch)
    good = demo_dir / "adapters" / "qv-r4"
    bad = tmp_path / "bad"
    shutil.copytree(good, bad)

    async def scenario() -> None:
        core = CoreClient(demo_dir / "model", EngineConfig(num_pages=64))
        await core.start()
        try:
            manager = AdapterManager(core, cache, WorkerMetrics())
            await manager.apply(placement(bad, "0" * 64))  # the digest can never match
            for _ in range(3):
                with pytest.raises(ServiceError, match="sha256") as err:
                    await manager.ensure("qv", "v1")
                assert err.value.adapter_error
            assert len(fetches) == 1  # refused from memory after the first failure
            await manager.apply(placement(good, digest_adapter_dir(good)))  # new files
            assert await manager.ensure("qv", "v1") == "qv@v1"
            assert len(fetches) == 2
            # Residency comes with the core's state reports (at most every 0.5 s).
            for _ in range(100):
                if manager.resident() == [("qv", "v1")]:
                    break
                await asyncio.sleep(0.05)
            assert manager.resident() == [("qv", "v1")]
        finally:
            await core.close()

    asyncio.run(scenario())


def test_a_failed_version_is_tried_again_after_the_retry_delay(demo_dir, tmp_path, monkeypatch):
    monkeypatch.setattr(adapters_mod, "FAILED_RETRY_S", 0.0)
    bad = tmp_path / "bad"
    shutil.copytree(demo_dir / "adapters" / "qv-r4", bad)
    cache = DiskCache(tmp_path / "cache")

    async def scenario() -> None:
        core = CoreClient(demo_dir / "model", EngineConfig(num_pages=64))
        await core.start()
        try:
            manager = AdapterManager(core, cache, WorkerMetrics())
            await manager.apply(placement(bad, digest_adapter_dir(bad)))
            (bad / "adapter_config.json").write_text("{broken")  # fails before it is fetched
            with pytest.raises(ServiceError) as err:
                await manager.ensure("qv", "v1")
            assert err.value.adapter_error
            shutil.rmtree(bad)
            shutil.copytree(demo_dir / "adapters" / "qv-r4", bad)  # repaired in place
            assert await manager.ensure("qv", "v1") == "qv@v1"
        finally:
            await core.close()

    asyncio.run(scenario())
