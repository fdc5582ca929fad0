"""The worker's local disk cache of adapter versions, filled from their storage URIs."""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import fsspec

from services.common.errors import InvalidArgument
from services.common.names import check_adapter_id, check_version, inside
from slora_core.adapters import AdapterFormatError, digest_adapter_dir
from slora_core.adapters.files import DIGEST_FILES


@dataclass(frozen=True)
class VersionSource:
    """Where a version's files live and the digest they must have."""

    adapter_id: str
    version: str
    storage_uri: str
    sha256: str


class DiskCache:
    """`root/<adapter_id>/<version>-<sha256[:16]>/` per version, written atomically.

    A directory is only ever renamed into place after its digest matched, so a present
    directory is a verified copy; its digest is still checked again on first use after a
    restart, in case the disk was tampered with or damaged."""

    def __init__(self, root: str | Path, s3_options: Mapping[str, Any] | None = None) -> None:
        self.root = Path(root)
        self.root.mkdir(parents=True, exist_ok=True)
        self.s3_options = dict(s3_options or {})
        self._verified: set[Path] = set()

    def path_of(self, src: VersionSource) -> Path:
        """Where `src` is kept; AdapterFormatError for names that are not valid ids or a path
        that would leave `root` (the control plane checks names too: this is the last line)."""
        try:
            check_adapter_id(src.adapter_id)
            check_version(src.version)
            return inside(self.root, src.adapter_id, f"{src.version}-{src.sha256[:16]}")
        except InvalidArgument as e:
            raise AdapterFormatError(str(e)) from None

    def fetch(self, src: VersionSource) -> tuple[Path, bool]:
        """The verified local directory of `src` and whether it was downloaded now.

        Blocking (run it in a thread). Raises AdapterFormatError when the files cannot be read
        or their sha256 differs from `src.sha256`."""
        dest = self.path_of(src)
        if dest in self._verified:
            return dest, False
        if dest.is_dir():
            if digest_adapter_dir(dest) == src.sha256:
                self._verified.add(dest)
                return dest, False
            shutil.rmtree(dest, ignore_errors=True)
        self._download(src, dest)
        self._verified.add(dest)
        return dest, True

    def _download(self, src: VersionSource, dest: Path) -> None:
        dest.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=".partial-", dir=dest.parent))
        try:
            fs, base = self._filesystem(src.storage_uri)
            for name in DIGEST_FILES:
                try:
                    fs.get_file(f"{base.rstrip('/')}/{name}", str(tmp / name))
                except (OSError, FileNotFoundError) as e:
                    raise AdapterFormatError(f"{src.storage_uri}: cannot fetch {name}: {e}") from None
            digest = digest_adapter_dir(tmp)
            if digest != src.sha256:
                raise AdapterFormatError(
                    f"{src.adapter_id}@{src.version}: sha256 of {src.storage_uri} is {digest}, "
                    f"the registry expects {src.sha256}"
                )
            os.replace(tmp, dest)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)

    def _filesystem(self, uri: str) -> tuple[Any, str]:
        options = self.s3_options if uri.startswith("s3://") else {}
        fs, path = fsspec.core.url_to_fs(uri, **options)
        return fs, path
