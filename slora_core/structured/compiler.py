"""Grammar compilation off the step loop: a thread pool, a time limit, and a cache.

    compiler = GrammarCompiler(backend, CompileLimits())
    pending = compiler.submit(spec)      # returns at once
    grammar = pending.poll()             # None until ready; raises StructuredOutputError

Compiled grammars are cached by (tokenizer identity, spec digest), least recently used first out
past `cache_bytes`; refusals are cached too, so a bad schema sent again is refused without a
compile. A compile that passes `timeout_s` fails its requests; its thread cannot be stopped and
runs on (the result, if any, is still cached), which is why the pool is small and a grammar's
text is capped (spec.MAX_SPEC_BYTES) before it gets here.
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field

from slora_core.structured.backend import Grammar, GrammarBackend
from slora_core.structured.spec import StructuredOutput, StructuredOutputError

MAX_CACHED_ERRORS = 1024


@dataclass(frozen=True)
class CompileLimits:
    timeout_s: float = 10.0      # from submission (queueing included) to a compiled grammar
    threads: int = 2
    cache_bytes: int = 256 * 2**20

    def __post_init__(self) -> None:
        if not self.timeout_s > 0:
            raise ValueError(f"timeout_s must be > 0, got {self.timeout_s}")
        if self.threads < 1:
            raise ValueError(f"threads must be >= 1, got {self.threads}")


@dataclass
class CompileStats:
    hits: int = 0
    misses: int = 0
    errors: int = 0
    timeouts: int = 0
    # Seconds each finished compile took on its thread (for p50/p99 reports).
    compile_s: list[float] = field(default_factory=list)


class PendingGrammar:
    """A grammar being compiled (or found in the cache) for one request."""

    def __init__(self, future: Future[Grammar], timeout_s: float, spec: StructuredOutput,
                 stats: CompileStats, backend_ready: Callable[[], bool]) -> None:
        self._future = future
        self._backend_ready = backend_ready
        # The clock starts once the backend exists: its one-off build is not the grammar's.
        self._deadline = time.monotonic() + timeout_s if backend_ready() else None
        self._timeout_s = timeout_s
        self._spec = spec
        self._stats = stats

    def poll(self) -> Grammar | None:
        """The grammar once compiled; None while it compiles. Raises StructuredOutputError
        when it was refused or did not compile within the time limit."""
        if self._future.done():
            return self._future.result()  # raises the compile's StructuredOutputError
        if self._deadline is None:
            if self._backend_ready():
                self._deadline = time.monotonic() + self._timeout_s
            return None
        if time.monotonic() >= self._deadline:
            self._stats.timeouts += 1
            raise StructuredOutputError(
                f"{self._spec.kind} did not compile within {self._timeout_s:g} s")
        return None

    @property
    def future(self) -> Future[Grammar]:
        return self._future


class GrammarCompiler:
    """Compiles `StructuredOutput`s for one `GrammarBackend` on a few threads, with a cache.
    `submit` is safe to call from one thread (the step loop); compiles finish on the pool.

    `backend` is a GrammarBackend or a function making one (with `identity`, the tokenizer's
    identity it will have): the grammar libraries take seconds to import, so an engine builds
    its backend on the pool, when the first grammar (or `prepare`) asks for it."""

    def __init__(self, backend: GrammarBackend | Callable[[], GrammarBackend],
                 limits: CompileLimits | None = None,
                 identity: str | Callable[[], str] | None = None) -> None:
        self._identity: str | Callable[[], str]
        if isinstance(backend, GrammarBackend):
            self._backend: GrammarBackend | None = backend
            self._make_backend: Callable[[], GrammarBackend] | None = None
            self._identity = backend.identity
        else:
            if identity is None:
                raise ValueError("a backend factory needs the tokenizer identity")
            self._backend, self._make_backend, self._identity = None, backend, identity
        self._backend_lock = threading.Lock()
        self.limits = limits or CompileLimits()
        self.stats = CompileStats()
        self._pool = ThreadPoolExecutor(self.limits.threads, thread_name_prefix="grammar")
        self._lock = threading.Lock()
        self._cache: OrderedDict[tuple[str, str], Grammar] = OrderedDict()
        self._cache_bytes = 0
        self._errors: OrderedDict[tuple[str, str], str] = OrderedDict()
        self._inflight: dict[tuple[str, str], Future[Grammar]] = {}

    def submit(self, spec: StructuredOutput) -> PendingGrammar:
        """Start compiling `spec` (or take it from the cache, or join a compile of the same
        spec already running); never waits."""
        key = (self.identity, spec.digest)
        with self._lock:
            future = self._lookup(key)
            if future is None:
                self.stats.misses += 1
                future = self._pool.submit(self._compile, key, spec)
                self._inflight[key] = future
        return PendingGrammar(future, self.limits.timeout_s, spec, self.stats,
                              lambda: self._backend is not None)

    def compile_now(self, spec: StructuredOutput) -> Grammar:
        """Compile on the pool, waiting up to the time limit (tests, tools)."""
        self.backend  # noqa: B018 - built first: its build is not the grammar's time
        pending = self.submit(spec)
        try:
            return pending.future.result(timeout=self.limits.timeout_s)
        except TimeoutError:
            self.stats.timeouts += 1
            raise StructuredOutputError(
                f"{spec.kind} did not compile within {self.limits.timeout_s:g} s") from None

    @property
    def identity(self) -> str:
        """The tokenizer's identity (a function giving it is called once, on first use)."""
        if not isinstance(self._identity, str):
            self._identity = self._identity()
        return self._identity

    @property
    def backend(self) -> GrammarBackend:
        """The backend, built on first use (on the calling thread)."""
        with self._backend_lock:
            if self._backend is None:
                assert self._make_backend is not None
                self._backend = self._make_backend()
            return self._backend

    def prepare(self) -> Future[GrammarBackend]:
        """Build the backend on the pool now (engine start), so the first grammar does not
        wait for the libraries' import."""
        return self._pool.submit(lambda: self.backend)

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)

    def _lookup(self, key: tuple[str, str]) -> Future[Grammar] | None:
        """A finished or running future for `key`, or None (the lock is held)."""
        future: Future[Grammar] = Future()
        if key in self._cache:
            self._cache.move_to_end(key)
            self.stats.hits += 1
            future.set_result(self._cache[key])
            return future
        if key in self._errors:
            self.stats.hits += 1
            future.set_exception(StructuredOutputError(self._errors[key]))
            return future
        return self._inflight.get(key)

    def _compile(self, key: tuple[str, str], spec: StructuredOutput) -> Grammar:
        try:
            backend = self.backend  # built on first use: not part of this grammar's time
            start = time.perf_counter()
            grammar = backend.compile(spec)
        except StructuredOutputError as e:
            with self._lock:
                self.stats.errors += 1
                self._errors[key] = str(e)
                while len(self._errors) > MAX_CACHED_ERRORS:
                    self._errors.popitem(last=False)
                self._inflight.pop(key, None)
            raise
        except BaseException:
            with self._lock:
                self._inflight.pop(key, None)
            raise
        with self._lock:
            self.stats.compile_s.append(time.perf_counter() - start)
            self._store(key, grammar)
            self._inflight.pop(key, None)
        return grammar

    def _store(self, key: tuple[str, str], grammar: Grammar) -> None:
        self._cache[key] = grammar
        self._cache_bytes += grammar.size_bytes
        while self._cache_bytes > self.limits.cache_bytes and len(self._cache) > 1:
            _, old = self._cache.popitem(last=False)
            self._cache_bytes -= old.size_bytes
