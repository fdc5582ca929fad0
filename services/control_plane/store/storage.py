"""Fetching an adapter directory from its storage URI (file:// or s3://) into a local folder,
streamed in 1 MiB chunks and hashed on the way (never whole in memory)."""

from __future__ import annotations

import hashlib
import os
import shutil
import tempfile
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import unquote, urlsplit

import fsspec

from services.common.errors import InvalidArgument
from services.common.names import shown
from slora_core.adapters.files import DIGEST_FILES

# A rank-128 adapter on every module of Llama-70B holds ~1.65 G parameters (3.3 GB in fp16);
# refuse files past this before downloading them.
DEFAULT_MAX_ADAPTER_BYTES = 4 << 30
CHUNK_BYTES = 1 << 20


@dataclass(frozen=True)
class StorageConfig:
    """Where adapters may come from.

    `allowed_roots`: file:// URIs must resolve (symlinks followed) inside one of these folders.
    `s3_options`: keyword arguments for s3fs (e.g. `{"endpoint_url": ...}`); credentials come from
    the usual AWS environment variables.
    """

    allowed_roots: tuple[Path, ...] = ()
    s3_options: Mapping[str, Any] = field(default_factory=dict)
    max_adapter_bytes: int = DEFAULT_MAX_ADAPTER_BYTES


def fetch_adapter(uri: str, dest: Path, config: StorageConfig,
                  limits: Mapping[str, int] | None = None) -> str:
    """Copy the adapter's files named in DIGEST_FILES from `uri` into `dest`, hashing them on the
    way; return their digest (the layout of `digest_adapter_dir`).

    `limits` caps each file's size by name (default: `config.max_adapter_bytes`, and the smaller
    of the two applies); a file over its cap is refused before any byte of it is read when the
    storage reports its size, and while streaming otherwise. Raises InvalidArgument for an
    unsupported scheme, a file:// path outside the allowed roots, a missing bucket or file, or a
    file over its limit. The validator then reads `dest`."""
    fs, base = _open_storage(uri, config)
    caps = {name: min(config.max_adapter_bytes, (limits or {}).get(name, config.max_adapter_bytes))
            for name in DIGEST_FILES}
    sizes = {name: _checked_size(fs, f"{base}/{name}", uri, caps[name]) for name in DIGEST_FILES}
    dest.mkdir(parents=True, exist_ok=True)
    digest = hashlib.sha256()
    for name in DIGEST_FILES:
        digest.update(name.encode("utf-8") + b"\0" + str(sizes[name]).encode("ascii") + b"\0")
        _stream_one(fs, f"{base}/{name}", dest / name, uri, sizes[name], digest)
    return digest.hexdigest()


def _open_storage(uri: str, config: StorageConfig) -> tuple[Any, str]:
    parts = urlsplit(uri)
    if parts.scheme == "file":
        local = _check_inside_roots(_local_path(parts), config)
        for name in DIGEST_FILES:
            # Each file too: a symlinked file must not lead outside the roots either.
            _check_inside_roots(local / name, config)
        return fsspec.filesystem("file"), str(local)
    if parts.scheme == "s3":
        if not parts.netloc:
            raise InvalidArgument(f"storage_uri {shown(uri)} names no bucket")
        fs = fsspec.filesystem("s3", skip_instance_cache=True, **dict(config.s3_options))
        if not _bucket_exists(fs, parts.netloc):
            raise InvalidArgument(f"{shown(uri)}: bucket {parts.netloc!r} does not exist or is not readable")
        return fs, f"{parts.netloc}/{parts.path.strip('/')}".rstrip("/")
    raise InvalidArgument(f"storage_uri {shown(uri)}: scheme must be file:// or s3://")


def _local_path(parts: Any) -> Path:
    if parts.netloc not in ("", "localhost"):
        raise InvalidArgument(f"file:// URI with host {parts.netloc!r}; only local paths are allowed")
    path = Path(unquote(parts.path))
    if not path.is_absolute():
        raise InvalidArgument(f"file:// path {path} is not absolute")
    return path


def _check_inside_roots(path: Path, config: StorageConfig) -> Path:
    """The real path of `path`, refused unless it lies inside an allowed root."""
    # Resolve symlinks and '..' before comparing, so a link cannot lead outside the roots.
    real = Path(os.path.realpath(path))
    roots = [Path(os.path.realpath(r)) for r in config.allowed_roots]
    if not any(real == root or real.is_relative_to(root) for root in roots):
        raise InvalidArgument(f"file:// path {path} lies outside the allowed roots")
    return real


def _checked_size(fs: Any, src: str, uri: str, max_bytes: int) -> int:
    """The file's size as the storage reports it; refused past `max_bytes` before reading."""
    name = src.rsplit("/", 1)[-1]
    try:
        info = fs.info(src)
    except FileNotFoundError:
        raise InvalidArgument(f"{uri}: {name} not found") from None
    except OSError as e:
        raise InvalidArgument(f"{uri}: cannot read {name}: {e}") from None
    if info.get("type") != "file":
        raise InvalidArgument(f"{uri}: {name} is not a file")
    size = int(info.get("size") or 0)
    if size > max_bytes:
        raise InvalidArgument(f"{uri}: {name} is {size} bytes, over the {max_bytes} bytes an "
                              "adapter of this base model can need at the rank limit")
    return size


def _stream_one(fs: Any, src: str, dest: Path, uri: str, size: int, digest: Any) -> None:
    """Copy `src` to `dest` in chunks, feeding `digest`; refuse a file that is not `size` bytes
    (it changed since it was sized: the digest's length prefix would be wrong)."""
    name, copied = src.rsplit("/", 1)[-1], 0
    try:
        with fs.open(src, "rb") as reader, dest.open("wb") as writer:
            while chunk := reader.read(min(CHUNK_BYTES, size - copied + 1)):
                copied += len(chunk)
                if copied > size:
                    break
                digest.update(chunk)
                writer.write(chunk)
    except FileNotFoundError:
        raise InvalidArgument(f"{uri}: {name} not found") from None
    except OSError as e:
        raise InvalidArgument(f"{uri}: cannot download {name}: {e}") from None
    if copied != size:
        raise InvalidArgument(f"{uri}: {name} changed while it was downloaded; try again")


def _bucket_exists(fs: Any, bucket: str) -> bool:
    try:
        return bool(fs.exists(bucket))
    except OSError:
        return False


STAGING_PREFIX = "slora-register-"


def staging_dir() -> tempfile.TemporaryDirectory[str]:
    """A temporary folder for one registration, named after this process (`slora-register-
    <pid>-...`) so that `clean_stale_staging` can tell a dead process's leftovers from a live
    control plane's downloads in progress."""
    return tempfile.TemporaryDirectory(prefix=f"{STAGING_PREFIX}{os.getpid()}-")


def clean_stale_staging(root: str | Path | None = None) -> list[Path]:
    """Remove registration folders left by processes that no longer run (a control plane
    killed mid-download); returns what was removed. Run at start-up."""
    removed = []
    for path in Path(root or tempfile.gettempdir()).glob(f"{STAGING_PREFIX}*"):
        pid = path.name[len(STAGING_PREFIX):].split("-", 1)[0]
        if path.is_dir() and not path.is_symlink() and pid.isdigit() and not _alive(int(pid)):
            shutil.rmtree(path, ignore_errors=True)
            removed.append(path)
    return removed


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # someone else's process
    return True
