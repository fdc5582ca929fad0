"""A persistent cache of compiled Triton kernels, one folder per (device, driver, toolchain,
kernel source), so a restart loads binaries instead of compiling them, and never loads a
binary built for something else.

    cache = CompileCache.open(Path("/var/cache/slora/.compiled"), device="cuda")
    cache.activate()          # TRITON_CACHE_DIR -> <root>/<digest>/triton
    ... build the engine, warm up ...
    cache.record(stats)       # the manifest notes what this start compiled and found

Triton's own cache keys already cover a kernel's source and Triton's version; the folder key
adds what they leave out or what an operator may change under a running deployment: the GPU
model and compute capability, the NVIDIA driver, torch's CUDA runtime, torch, Python, and the
source of every file in `slora_kernels/` (a launcher change that picks other constexprs, too). A
change of any of them is a new folder, so a stale binary is never found; a folder whose
manifest is unreadable or names another key is emptied and rebuilt.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import logging
import os
import platform
import shutil
import threading
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

MANIFEST = "manifest.json"
TRITON_SUBDIR = "triton"
# Folders of other keys kept beside the current one (an image rolled back to the previous
# driver or kernels finds its binaries); older ones are removed.
KEEP_OTHER_KEYS = 3
KEEP_WARMUPS = 16  # warm-up digests a manifest remembers (CompileCache.holds)
# Bump when the folder layout or the manifest's meaning changes.
LAYOUT_VERSION = 1
KERNELS_DIR = Path(__file__).resolve().parent.parent / "slora_kernels"


@dataclass(frozen=True)
class CacheKey:
    """Everything a compiled kernel binary depends on beyond Triton's own key."""

    device: str    # GPU name and compute capability ("NVIDIA H200 sm_90"), or "cpu"
    driver: str    # NVIDIA kernel-module version and CUDA driver API version
    cuda: str      # torch's CUDA runtime ("12.8"), "" on a CPU build
    triton: str
    torch: str
    python: str
    kernels: str   # sha256 of slora_kernels/*.py (kernel_source_digest)
    layout: int = LAYOUT_VERSION

    def digest(self) -> str:
        """A stable hex digest of every field (the folder name)."""
        text = json.dumps(asdict(self), sort_keys=True)
        return hashlib.sha256(text.encode()).hexdigest()

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> CacheKey:
        """The key a manifest records; ValueError when it is not one."""
        names = {f.name for f in fields(cls)}
        if not isinstance(raw, dict) or set(raw) != names:
            raise ValueError(f"not a cache key: {raw!r:.200}")
        return cls(**raw)


def kernel_source_digest(root: Path = KERNELS_DIR) -> str:
    """sha256 over the names and bytes of `root`'s *.py files, in name order."""
    h = hashlib.sha256()
    for path in sorted(root.glob("*.py")):
        h.update(path.name.encode() + b"\0")
        h.update(path.read_bytes())
        h.update(b"\0")
    return h.hexdigest()


def _nvidia_module_version() -> str:
    """The loaded NVIDIA kernel module's version ("570.86.15"), or "" without one."""
    try:
        first = Path("/proc/driver/nvidia/version").read_text().splitlines()[0]
    except (OSError, IndexError):
        return ""
    words = first.split()
    # "NVRM version: NVIDIA UNIX x86_64 Kernel Module  570.86.15  Tue ..."
    for i, word in enumerate(words[:-1]):
        if word == "Module":
            return words[i + 1]
    return first.strip()


def device_identity(device: str) -> tuple[str, str]:
    """(device, driver) fields of the key for a torch device string."""
    import torch

    if not device.startswith("cuda") or not torch.cuda.is_available():
        return "cpu", ""
    index = torch.device(device).index or 0
    major, minor = torch.cuda.get_device_capability(index)
    name = f"{torch.cuda.get_device_name(index)} sm_{major}{minor}"
    get_driver = getattr(torch._C, "_cuda_getDriverVersion", None)
    api = str(get_driver()) if get_driver is not None else ""
    return name, f"{_nvidia_module_version()} cuda-api {api}".strip()


def current_key(device: str, kernels_dir: Path = KERNELS_DIR) -> CacheKey:
    """The key of this process on `device` (initialises CUDA for a CUDA device)."""
    import torch
    import triton

    name, driver = device_identity(device)
    return CacheKey(device=name, driver=driver, cuda=torch.version.cuda or "",
                    triton=triton.__version__, torch=torch.__version__,
                    python=platform.python_version(), kernels=kernel_source_digest(kernels_dir))


@contextlib.contextmanager
def _locked(root: Path) -> Iterator[None]:
    """An exclusive lock on `root` (workers of one host may share a cache directory)."""
    root.mkdir(parents=True, exist_ok=True)
    with open(root / ".lock", "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def _write_json(path: Path, data: dict[str, Any]) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(data, indent=1, sort_keys=True))
    os.replace(tmp, path)


@dataclass
class CompileCache:
    """One key's folder under `root`: `<root>/<digest>/` holds manifest.json and Triton's
    cache (`triton/`). `state` says what `open` found: "warm" (a valid manifest of this key),
    "cold" (no folder yet) or "rebuilt: <why>" (a folder it could not trust, emptied)."""

    root: Path
    key: CacheKey
    state: str = "cold"

    @property
    def path(self) -> Path:
        return self.root / self.key.digest()[:32]

    @property
    def triton_dir(self) -> Path:
        return self.path / TRITON_SUBDIR

    @property
    def manifest_path(self) -> Path:
        return self.path / MANIFEST

    @classmethod
    def open(cls, root: Path, device: str = "cpu", key: CacheKey | None = None) -> CompileCache:
        """The folder of `key` (default: this process's `current_key(device)`) under `root`,
        checked: a manifest that cannot be read, or that records another key (a folder copied
        from elsewhere, a digest collision), empties the folder first. Writes the manifest.
        Prunes other keys' folders beyond KEEP_OTHER_KEYS, least recently used first."""
        cache = cls(Path(root), key or current_key(device))
        with _locked(cache.root):
            cache.state = cache._check()
            cache._write_manifest(opened=True)
            cache._prune()
        return cache

    def _check(self) -> str:
        if not self.path.exists():
            return "cold"
        why = self._distrust()
        if why is None:
            return "warm"
        log.warning("compile cache %s: %s; emptied and rebuilt", self.path, why)
        shutil.rmtree(self.path, ignore_errors=True)
        return f"rebuilt: {why}"

    def _distrust(self) -> str | None:
        """Why the folder's content cannot be used, or None when it can."""
        try:
            manifest = json.loads(self.manifest_path.read_text())
        except FileNotFoundError:
            return "no manifest"
        except (OSError, ValueError) as e:
            return f"unreadable manifest ({e})"
        if not isinstance(manifest, dict):
            return "unreadable manifest (not an object)"
        try:
            recorded = CacheKey.from_dict(manifest.get("key"))  # type: ignore[arg-type]
        except (TypeError, ValueError):
            return "manifest without a valid key"
        if recorded != self.key or manifest.get("digest") != self.key.digest():
            return "manifest of another key"
        return None

    def manifest(self) -> dict[str, Any]:
        """The manifest as written ({} if it cannot be read)."""
        try:
            data = json.loads(self.manifest_path.read_text())
        except (OSError, ValueError):
            return {}
        return data if isinstance(data, dict) else {}

    def _write_manifest(self, opened: bool = False, **fields_: Any) -> None:
        self.path.mkdir(parents=True, exist_ok=True)
        old = self.manifest() if self.state == "warm" or not opened else {}
        now = time.time()
        data = {**old, "key": asdict(self.key), "digest": self.key.digest(),
                "created": old.get("created", now), "last_used": now, **fields_}
        if opened:
            data["starts"] = int(old.get("starts", 0)) + 1
        _write_json(self.manifest_path, data)

    def _prune(self) -> None:
        others = []
        for d in self.root.iterdir():
            if d.is_dir() and d != self.path and not d.name.startswith("."):
                try:
                    used = float(json.loads((d / MANIFEST).read_text())["last_used"])
                except (OSError, ValueError, KeyError, TypeError):
                    used = 0.0
                others.append((used, d))
        for _, d in sorted(others, reverse=True)[KEEP_OTHER_KEYS:]:
            shutil.rmtree(d, ignore_errors=True)

    def activate(self) -> None:
        """Point Triton's on-disk cache at this folder (read when a kernel compiles, so call it
        before the first launch; the process's earlier compiled kernels are unaffected)."""
        self.triton_dir.mkdir(parents=True, exist_ok=True)
        os.environ["TRITON_CACHE_DIR"] = str(self.triton_dir)

    def record(self, **facts: Any) -> None:
        """Note facts of this start in the manifest (kernels compiled, found, seconds)."""
        with _locked(self.root):
            self._write_manifest(last_start=facts)

    def holds(self, warmup: str) -> bool:
        """Whether a start of this folder compiled every kernel of `warmup` (a digest of what
        a warm-up launches: warmup_digest) before, so its binaries are here."""
        return warmup in self.manifest().get("warmups", [])

    def note_warmup(self, warmup: str) -> None:
        """Record that this folder now holds every kernel `warmup` launches (holds)."""
        with _locked(self.root):
            known = [w for w in self.manifest().get("warmups", []) if w != warmup]
            self._write_manifest(warmups=[*known, warmup][-KEEP_WARMUPS:])


def warmup_digest(*parts: Any) -> str:
    """A digest of what decides the kernels a warm-up compiles (the model's shape and dtype,
    the engine's settings, the graphs queued), for CompileCache.holds."""
    return hashlib.sha256(json.dumps(parts, sort_keys=True, default=repr).encode()).hexdigest()


_LISTENER_LOCK = threading.Lock()


@dataclass
class CompileStats:
    """Kernel compilations Triton reported while installed (`install`): binaries compiled
    (misses) and found in the on-disk cache (hits), with the seconds each took."""

    compiled: int = 0
    cache_hits: int = 0
    compile_s: float = 0.0
    load_s: float = 0.0

    def snapshot(self) -> CompileStats:
        return CompileStats(self.compiled, self.cache_hits, self.compile_s, self.load_s)

    def since(self, before: CompileStats) -> CompileStats:
        return CompileStats(self.compiled - before.compiled, self.cache_hits - before.cache_hits,
                            self.compile_s - before.compile_s, self.load_s - before.load_s)

    def __call__(self, *, src: Any, metadata: Any, metadata_group: Any, times: Any,
                 cache_hit: bool) -> None:
        """Triton's compilation listener (triton.knobs.compilation.listener)."""
        total = (times.ir_initialization + sum(us for _, us in times.lowering_stages)
                 + times.store_results) / 1e6
        with _LISTENER_LOCK:  # compilations run on several threads (slora_core.precompile)
            if cache_hit:
                self.cache_hits += 1
                self.load_s += total
            else:
                self.compiled += 1
                self.compile_s += total

    def install(self) -> None:
        """Receive every compilation of this process (one listener a process)."""
        from triton import knobs

        knobs.compilation.listener = self
