"""The engine's constrained requests: grammars waiting to compile, and each running request's
matcher.

    grammars.submit("r1", spec)          # add_request: compile starts off the loop
    ready, failed = grammars.poll()      # each step: ready ones join the scheduler
    mask = grammars.mask(["r1", "r2"])   # before sampling: rows of constrained requests
    grammars.accept("r1", token_id)      # after sampling: advance the matcher
    grammars.release("r1")               # finished or aborted

A request waits outside the batch until its grammar is ready; every other request keeps
stepping meanwhile.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Mapping
from concurrent.futures import FIRST_COMPLETED, wait
from typing import Any

from slora_core.structured.backend import (
    GrammarBackend,
    Matcher,
    XgrammarMatcher,
    tokenizer_identity,
)
from slora_core.structured.bitmask import GrammarMask, new_bitmask
from slora_core.structured.compiler import CompileLimits, GrammarCompiler, PendingGrammar
from slora_core.structured.spec import StructuredOutput, StructuredOutputError

# RequestOutput.error_kind of a request whose grammar was refused or did not compile in time
# (the service maps it to INVALID_ARGUMENT: the request, not the server, is at fault).
GRAMMAR_ERROR = "grammar"
# Threads xgrammar fills a step's masks on (the step loop waits for them, while the GPU runs the
# step's forward).
FILL_THREADS = min(8, os.cpu_count() or 1)


class GrammarRequests:
    """Per-request grammar state for one engine (one tokenizer and vocabulary)."""

    def __init__(self, backend: GrammarBackend | Callable[[], GrammarBackend], vocab_size: int,
                 limits: CompileLimits | None = None, pin_memory: bool = False,
                 identity: str | Callable[[], str] | None = None) -> None:
        """`backend`: see GrammarCompiler (a factory needs `identity`)."""
        self.compiler = GrammarCompiler(backend, limits, identity)
        self.vocab_size = vocab_size
        self._pin = pin_memory
        self._pending: dict[str, PendingGrammar] = {}
        self._batch: Any = None  # xgrammar's BatchGrammarMatcher, made on first use
        self._matchers: dict[str, Matcher] = {}
        # Seconds from submission until the grammar was ready, per request (bench reports).
        self.wait_s: list[float] = []
        self._submitted: dict[str, float] = {}

    def submit(self, request_id: str, spec: StructuredOutput) -> None:
        self._pending[request_id] = self.compiler.submit(spec)
        self._submitted[request_id] = time.monotonic()

    @property
    def has_pending(self) -> bool:
        return bool(self._pending)

    @property
    def active(self) -> bool:
        """Some request has a grammar (compiling or in use): the engine has work here."""
        return bool(self._pending or self._matchers)

    def is_pending(self, request_id: str) -> bool:
        return request_id in self._pending

    def poll(self) -> tuple[list[str], list[tuple[str, str]]]:
        """Requests whose grammar became ready (they may be scheduled now), and requests whose
        grammar failed, with the error (the engine ends them)."""
        ready: list[str] = []
        failed: list[tuple[str, str]] = []
        for rid, pending in list(self._pending.items()):
            try:
                grammar = pending.poll()
            except StructuredOutputError as e:
                failed.append((rid, str(e)))
            except Exception as e:  # noqa: BLE001 - a backend failure ends this request only
                failed.append((rid, f"grammar compile failed: {e}"))
            else:
                if grammar is None:
                    continue
                self._matchers[rid] = grammar.matcher()
                ready.append(rid)
                self.wait_s.append(time.monotonic() - self._submitted[rid])
            del self._pending[rid]
            self._submitted.pop(rid, None)
        return ready, failed

    def admit(self, live: Mapping[str, Any]) -> list[tuple[str, str]]:
        """`poll`, for an engine whose `live` requests (id -> object with `.seq`) wait with
        `seq.grammar_ready` False: ready ones may now be scheduled; returns the failed ones
        (id, error) still live, for the engine to end."""
        ready, failed = self.poll()
        for rid in ready:
            if rid in live:
                live[rid].seq.grammar_ready = True
        return [(rid, error) for rid, error in failed if rid in live]

    def retain(self, live: Mapping[str, Any]) -> None:
        """Forget the grammar state of requests no longer live (finished, aborted)."""
        for rid in [r for r in self._matchers if r not in live]:
            del self._matchers[rid]
        for rid in [r for r in self._pending if r not in live]:
            self.release(rid)

    def after_token(self, request_id: str, token_id: int) -> str | None:
        """Advance by a sampled token. None: go on; "stop": the grammar is complete (the
        request ends); otherwise the error that ends it (a token the mask forbade)."""
        if request_id not in self._matchers:
            return None
        if not self.accept(request_id, token_id):
            return f"token {token_id} broke the request's grammar"
        return "stop" if self.is_terminated(request_id) else None

    def wait(self, timeout_s: float) -> None:
        """Block until a pending compile finishes or `timeout_s` passes (an idle engine)."""
        futures = [p.future for p in self._pending.values()]
        if futures:
            wait(futures, timeout=timeout_s, return_when=FIRST_COMPLETED)

    def is_constrained(self, request_id: str) -> bool:
        return request_id in self._matchers

    def mask(self, request_ids: list[str]) -> GrammarMask | None:
        """The bitmask of the batch rows whose request has a grammar (row i = request_ids[i]);
        None when no row has one."""
        rows = [i for i, rid in enumerate(request_ids) if rid in self._matchers]
        if not rows:
            return None
        bitmask = new_bitmask(len(rows), self.vocab_size, self._pin)
        matchers = [self._matchers[request_ids[i]] for i in rows]
        batched = [(j, m) for j, m in enumerate(matchers) if isinstance(m, XgrammarMatcher)]
        if len(batched) > 1:
            # xgrammar fills the rows on its own threads (a fill is 10 us to a few ms).
            self._batch_filler().batch_fill_next_token_bitmask(
                [m.raw for _, m in batched], bitmask, indices=[j for j, _ in batched])
            for j, xm in batched:
                xm.finish_row(bitmask, j)
            done = {j for j, _ in batched}
        else:
            done = set()
        for j, m in enumerate(matchers):
            if j not in done:
                m.fill(bitmask, j)
        return GrammarMask(bitmask, tuple(rows))

    def _batch_filler(self) -> Any:
        if self._batch is None:
            import xgrammar as xgr

            self._batch = xgr.BatchGrammarMatcher(max_threads=FILL_THREADS)
        return self._batch

    def accept(self, request_id: str, token_id: int) -> bool:
        """Advance a constrained request by its sampled token; True for unconstrained ones.
        False means the token broke the grammar (the engine ends the request)."""
        matcher = self._matchers.get(request_id)
        return matcher is None or matcher.accept(token_id)

    def is_terminated(self, request_id: str) -> bool:
        """The request's grammar is complete: nothing more may be generated."""
        matcher = self._matchers.get(request_id)
        return matcher is not None and matcher.is_terminated()

    def release(self, request_id: str) -> None:
        self._pending.pop(request_id, None)
        self._submitted.pop(request_id, None)
        self._matchers.pop(request_id, None)

    def close(self) -> None:
        self.compiler.close()


def grammars_for(tokenizer: Any, vocab_size: int, stop_token_ids: tuple[int, ...],
                 timeout_s: float, pin_memory: bool) -> GrammarRequests | None:
    """An engine's grammar state over its `slora_core.tokenizer.Tokenizer` (None without one:
    grammars need the vocabulary's text). Nothing is imported or built until a request asks."""
    if tokenizer is None:
        return None
    backend = tokenizer.backend
    stops = tuple(stop_token_ids)
    return GrammarRequests(lambda: GrammarBackend(backend, vocab_size, stops), vocab_size,
                           CompileLimits(timeout_s=timeout_s), pin_memory,
                           lambda: tokenizer_identity(backend, vocab_size, stops))
