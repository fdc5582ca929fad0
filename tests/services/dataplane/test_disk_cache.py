"""The worker's disk cache: fetch by storage URI, sha256 checked on download and after a
restart, nothing half-written left behind."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from services.worker.disk_cache import DiskCache, VersionSource
from slora_core.adapters import AdapterFormatError, digest_adapter_dir


def source(path: Path, sha256: str | None = None) -> VersionSource:
    return VersionSource("qv", "v1", path.resolve().as_uri(), sha256 or digest_adapter_dir(path))


def test_fetch_verifies_and_reuses(demo_dir: Path, tmp_path: Path) -> None:
    src = source(demo_dir / "adapters" / "qv-r4")
    cache = DiskCache(tmp_path / "cache")
    path, downloaded = cache.fetch(src)
    assert downloaded and digest_adapter_dir(path) == src.sha256
    assert cache.fetch(src) == (path, False)
    # A new process (empty memo) re-checks the digest of what it finds on disk.
    (path / "adapter_config.json").write_text("{}")
    path2, downloaded = DiskCache(tmp_path / "cache").fetch(src)
    assert path2 == path and downloaded and digest_adapter_dir(path) == src.sha256


def test_checksum_mismatch_is_refused_and_leaves_nothing(demo_dir: Path, tmp_path: Path) -> None:
    copy = tmp_path / "adapter"
    shutil.copytree(demo_dir / "adapters" / "qv-r4", copy)
    src = source(copy)
    (copy / "adapter_config.json").write_text((copy / "adapter_config.json").read_text() + " ")
    cache = DiskCache(tmp_path / "cache")
    with pytest.raises(AdapterFormatError, match="sha256"):
        cache.fetch(src)
    assert list((tmp_path / "cache" / "qv").iterdir()) == []


def test_missing_files_are_an_adapter_error(tmp_path: Path) -> None:
    with pytest.raises(AdapterFormatError, match="cannot fetch"):
        DiskCache(tmp_path / "cache").fetch(VersionSource("a", "v1", (tmp_path / "nope").as_uri(),
                                                          "0" * 64))
