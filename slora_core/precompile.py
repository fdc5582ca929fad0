"""Compile a start-up's Triton kernels side by side instead of one at a time.

A CUDA worker's graph capture used to compile each kernel specialization when a warm-up
forward first launched it: 75 compilations one after another, 120 of a cold 7B start's 153 s
on the H200 (worker-startup-h200.json). Start-up now runs every forward it is about to capture
once with Triton's `jit_cache_hook` recording each specialization that is not compiled yet and
skipping its launch (nothing runs, nothing compiles), then compiles what was recorded on a
thread pool under Triton's `AsyncCompileMode` (the MLIR and LLVM passes and ptxas run outside
the GIL: eight kernels in 0.57x the time on two threads of a 2-core CPU,
kernel-compile-threads-cpu.json), and captures as before, every kernel now in memory or in the
on-disk cache.

    with MissingKernels() as missing:
        for forward in forwards:
            forward()                      # launches of uncompiled kernels are skipped
    compile_all(missing.found, workers=8)  # compiled, in Triton's in-memory and disk caches

Only this thread's launches are skipped: a launch from another thread (an adapter load beside
the warm-up) compiles and runs as usual. Triton is imported here only when used (a CPU
process never imports it).
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Protocol

log = logging.getLogger(__name__)


@dataclass
class MissingKernels:
    """While entered: launches (from this thread) of kernel specializations not compiled yet
    are recorded in `found` and skipped. Kernels already compiled launch as usual."""

    found: list[tuple[Any, str]] = field(default_factory=list)  # (JITFunction, specialization)
    _seen: set[tuple[int, str]] = field(default_factory=set)
    _previous: Any = None
    _thread: int = 0

    def _hook(self, *, key: Any, repr: str, fn: Any, compile: dict[str, Any],  # noqa: A002
              is_manual_warmup: bool, already_compiled: bool) -> bool | None:
        if threading.get_ident() != self._thread:
            return self._previous(key=key, repr=repr, fn=fn, compile=compile,
                                  is_manual_warmup=is_manual_warmup,
                                  already_compiled=already_compiled) if self._previous else None
        data = compile["specialization_data"]
        jit_function = fn.jit_function
        if (id(jit_function), data) not in self._seen:
            self._seen.add((id(jit_function), data))
            self.found.append((jit_function, data))
        return True  # skip: no compile and no launch

    def __enter__(self) -> MissingKernels:
        from triton import knobs

        self._thread = threading.get_ident()
        self._previous = knobs.runtime.jit_cache_hook
        knobs.runtime.jit_cache_hook = self._hook
        return self

    def __exit__(self, *exc: object) -> None:
        from triton import knobs

        knobs.runtime.jit_cache_hook = self._previous


def default_workers() -> int:
    """Compile threads: the cores this process may use, at most 16."""
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        cores = os.cpu_count() or 1
    return max(1, min(16, cores))


def compile_all(kernels: list[tuple[Any, str]], workers: int | None = None) -> float:
    """Compile every recorded specialization (Triton's disk cache answers those it holds) on
    `workers` threads; returns the seconds taken. Into Triton's in-memory kernel caches, so the
    launches that follow find them."""
    if not kernels:
        return 0.0
    from triton.runtime._async_compile import AsyncCompileMode

    t0 = time.perf_counter()
    workers = workers or default_workers()
    with ThreadPoolExecutor(workers, thread_name_prefix="triton-compile") as pool, \
            AsyncCompileMode(pool, ignore_errors=True):
        for jit_function, data in kernels:
            try:
                jit_function.preload(data)
            except Exception:  # the capture compiles it again and raises what it raises
                log.exception("cannot compile %s ahead of its launch", jit_function)
    seconds = time.perf_counter() - t0
    log.info("compiled or loaded %d Triton kernels on %d threads in %.1f s", len(kernels),
             workers, seconds)
    return seconds


class GraphSet(Protocol):
    def dry_forward(self, key: Any) -> None: ...


def precompile_graphs(queue: Sequence[tuple[GraphSet, Any]], workers: int | None = None,
                      ) -> float:
    """Every queued graph's forward run once, the launches of kernels not compiled yet skipped
    and recorded, then those compiled side by side; seconds taken (0.0 with none queued)."""
    if not queue:
        return 0.0
    t0 = time.perf_counter()
    missing = MissingKernels()
    try:
        with missing:
            for graphs, key in queue:
                graphs.dry_forward(key)
    except Exception:  # an optimisation only: the captures compile whatever is left
        log.exception("the dry forwards failed; compiling what they recorded")
    compile_all(missing.found, workers)
    return time.perf_counter() - t0
