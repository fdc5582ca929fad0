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

import time
from collections.abc import Callable
from concurrent.futures import FIRST_COMPLETED, wait

from slora_core.structured.backend import GrammarBackend, Matcher
from slora_core.structured.bitmask import GrammarMask, new_bitmask
from slora_core.structured.compiler import CompileLimits, GrammarCompiler, PendingGrammar
from slora_core.structured.spec import StructuredOutput, StructuredOutputError


class GrammarRequests:
    """Per-request grammar state for one engine (one tokenizer and vocabulary)."""

    def __init__(self, backend: GrammarBackend | Callable[[], GrammarBackend], vocab_size: int,
                 limits: CompileLimits | None = None, pin_memory: bool = False,
                 identity: str | None = None) -> None:
        """`backend`: see GrammarCompiler (a factory needs `identity`)."""
        self.compiler = GrammarCompiler(backend, limits, identity)
        self.vocab_size = vocab_size
        self._pin = pin_memory
        self._pending: dict[str, PendingGrammar] = {}
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
        for j, i in enumerate(rows):
            self._matchers[request_ids[i]].fill(bitmask, j)
        return GrammarMask(bitmask, tuple(rows))

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
