"""Fetching an adapter directory from its storage URI (file:// or s3://) into a local folder."""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import unquote, urlsplit

import fsspec

from services.control_plane.errors import InvalidArgument
from slora_core.adapters.files import DIGEST_FILES

# A rank-128 adapter on every module of Llama-70B holds ~1.65 G parameters (3.3 GB in fp16);
# refuse files past this before downloading them.
DEFAULT_MAX_ADAPTER_BYTES = 4 << 30


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


def fetch_adapter(uri: str, dest: Path, config: StorageConfig) -> Path:
    """Copy the adapter's files named in DIGEST_FILES from `uri` into `dest`; return `dest`.

    Raises InvalidArgument for an unsupported scheme, a file:// path outside the allowed roots,
    a missing bucket or file, or a file over the size limit. The validator then reads `dest`.
    """
    parts = urlsplit(uri)
    if parts.scheme == "file":
        local = _check_inside_roots(_local_path(parts), config)
        for name in DIGEST_FILES:
            # Each file too: a symlinked file must not lead outside the roots either.
            _check_inside_roots(local / name, config)
        fs, base = fsspec.filesystem("file"), str(local)
    elif parts.scheme == "s3":
        if not parts.netloc:
            raise InvalidArgument(f"storage_uri {uri!r} names no bucket")
        fs = fsspec.filesystem("s3", skip_instance_cache=True, **dict(config.s3_options))
        if not _bucket_exists(fs, parts.netloc):
            raise InvalidArgument(f"{uri}: bucket {parts.netloc!r} does not exist or is not readable")
        base = f"{parts.netloc}/{parts.path.strip('/')}".rstrip("/")
    else:
        raise InvalidArgument(f"storage_uri {uri!r}: scheme must be file:// or s3://")
    dest.mkdir(parents=True, exist_ok=True)
    for name in DIGEST_FILES:
        _copy_one(fs, f"{base}/{name}", dest / name, uri, config.max_adapter_bytes)
    return dest


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


def _copy_one(fs: Any, src: str, dest: Path, uri: str, max_bytes: int) -> None:
    try:
        info = fs.info(src)
    except FileNotFoundError:
        raise InvalidArgument(f"{uri}: {src.rsplit('/', 1)[-1]} not found") from None
    except OSError as e:
        raise InvalidArgument(f"{uri}: cannot read {src}: {e}") from None
    if info.get("type") != "file":
        raise InvalidArgument(f"{uri}: {src} is not a file")
    if int(info.get("size") or 0) > max_bytes:
        raise InvalidArgument(f"{uri}: {src} is {info['size']} bytes, over the {max_bytes} limit")
    try:
        fs.get_file(src, str(dest))
    except FileNotFoundError:
        raise InvalidArgument(f"{uri}: {src} not found") from None
    except OSError as e:
        raise InvalidArgument(f"{uri}: cannot download {src}: {e}") from None


def _bucket_exists(fs: Any, bucket: str) -> bool:
    try:
        return bool(fs.exists(bucket))
    except OSError:
        return False
