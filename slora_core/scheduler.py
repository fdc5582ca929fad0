"""Continuous batching with adapter grouping, chunked prefill, page-aware admission and
preemption by recomputation. Pure Python: no torch, testable in milliseconds."""

from __future__ import annotations

import time
from collections import Counter, deque
from collections.abc import Hashable
from dataclasses import dataclass, field

from slora_core.page_pool import OutOfPages, PagePool, ResidentAdapter
from slora_core.prefix_cache import block_hash
from slora_core.sequence import SeqStatus, Sequence
from slora_core.stats import EngineStats


@dataclass(frozen=True)
class SchedulerLimits:
    block_size: int
    max_num_seqs: int
    max_num_batched_tokens: int
    max_adapters_per_batch: int
    prefetch_depth: int = 8  # waiting requests whose adapters are loaded ahead into free pages
    max_model_len: int | None = None  # a sequence this long finishes ("length"); None: no cap
    # Full KV pages are cached by content (slora_core.prefix_cache) and a sequence admitted
    # takes its longest cached prefix instead of computing it.
    prefix_caching: bool = False


@dataclass(frozen=True)
class ScheduledSeq:
    seq: Sequence
    num_new_tokens: int
    adapter_slot: int = -1  # the arena slot of the sequence's adapter; -1 = base model

    @property
    def samples(self) -> bool:
        """True when this chunk reaches the end of the sequence, so its last logits are sampled."""
        return self.seq.num_computed_tokens + self.num_new_tokens == self.seq.num_tokens


@dataclass
class SchedulerOutput:
    scheduled: list[ScheduledSeq] = field(default_factory=list)  # grouped by adapter slot
    new_adapters: list[ResidentAdapter] = field(default_factory=list)  # to be written now
    evicted: list[ResidentAdapter] = field(default_factory=list)
    preempted: list[Sequence] = field(default_factory=list)
    expired: list[Sequence] = field(default_factory=list)  # waiting past their deadline

    @property
    def num_tokens(self) -> int:
        return sum(s.num_new_tokens for s in self.scheduled)

    def distinct_adapters(self) -> int:
        return len({s.seq.adapter for s in self.scheduled if s.seq.adapter is not None})


PLACEHOLDER = -1  # an output token id sampled on the device, not yet read by the host


class Scheduler:
    def __init__(self, limits: SchedulerLimits, pool: PagePool,
                 eos_token_ids: tuple[int, ...] = (), stats: EngineStats | None = None) -> None:
        self.limits = limits
        self.pool = pool
        self.eos_token_ids = eos_token_ids
        # Steps, tokens, preemptions and evictions, counted here as they happen.
        self.stats = stats if stats is not None else EngineStats()
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []

    # ---- queue management ----------------------------------------------------------------
    def add(self, seq: Sequence) -> None:
        seq.status = SeqStatus.WAITING
        self.waiting.append(seq)

    def finish(self, seq: Sequence) -> None:
        """Remove a sequence (finished or aborted) and give back its pages and adapter ref."""
        if seq.status is SeqStatus.RUNNING:
            self.running.remove(seq)
            self._release(seq)
        elif seq.status is SeqStatus.WAITING:
            self.waiting.remove(seq)
        seq.status = SeqStatus.FINISHED

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.limits.block_size)

    # ---- one step ------------------------------------------------------------------------
    def schedule(self, now: float | None = None) -> SchedulerOutput:
        out = SchedulerOutput()
        prefix_evictions = self.pool.prefix_evictions
        now = time.monotonic() if now is None else now
        self._expire_waiting(out, now)
        budget = self._schedule_running(out, self.limits.max_num_batched_tokens)
        if not out.preempted:
            self._admit_waiting(out, budget, now)
            self._prefetch(out)
        # Group by adapter so each adapter's tokens form one contiguous LoRA segment.
        out.scheduled.sort(key=lambda s: (s.seq.adapter is None, s.adapter_slot))
        self.stats.preemptions += len(out.preempted)
        self.stats.adapter_evictions += len(out.evicted)
        self.stats.prefix_evictions += self.pool.prefix_evictions - prefix_evictions
        return out

    def _schedule_running(self, out: SchedulerOutput, budget: int) -> int:
        i = 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            n = min(seq.num_uncomputed, budget)
            if n <= 0:
                i += 1
                continue
            need = self.blocks_for(seq.num_computed_tokens + n) - len(seq.block_table)
            if need > 0 and not self._grow(seq, need, out):
                # The youngest running sequence was preempted; if that was `seq`, we are done.
                if seq.status is not SeqStatus.RUNNING:
                    break
                continue
            out.scheduled.append(ScheduledSeq(seq, n, self._slot(seq)))
            budget -= n
            i += 1
        return budget

    def _slot(self, seq: Sequence) -> int:
        """The slot of a running sequence's adapter (resident while it runs), -1 for none."""
        rec = self.pool.resident(seq.adapter) if seq.adapter is not None else None
        return rec.slot if rec is not None else -1

    def _grow(self, seq: Sequence, need: int, out: SchedulerOutput) -> bool:
        """Give `seq` `need` more KV blocks, preempting the youngest running sequence if the
        arena cannot; returns False when a preemption happened instead."""
        try:
            pages, evicted = self.pool.allocate(need)
        except OutOfPages:
            victim = self.running[-1]
            self._preempt(victim, out)
            return False
        seq.block_table.extend(pages)
        out.evicted.extend(evicted)
        return True

    def _preempt(self, seq: Sequence, out: SchedulerOutput) -> None:
        self.running.remove(seq)
        self._release(seq)
        out.scheduled = [s for s in out.scheduled if s.seq is not seq]
        seq.num_computed_tokens = 0
        seq.num_preemptions += 1
        seq.status = SeqStatus.WAITING
        self.waiting.appendleft(seq)
        out.preempted.append(seq)

    def _release(self, seq: Sequence) -> None:
        self.pool.free(seq.block_table)  # cached pages stay, cold, for the next prefix hit
        seq.block_table = []
        seq.num_registered_blocks = 0
        if seq.adapter is not None and self.pool.is_resident(seq.adapter):
            self.pool.release_adapter(seq.adapter)

    def _adapters_running(self) -> set[Hashable]:
        return {s.adapter for s in self.running if s.adapter is not None}

    def _fair_order(self) -> list[Sequence]:
        """Waiting requests, interleaved across tenants: the tenant with the fewest running
        (and already picked) requests goes next; each tenant's own queue stays in order, so
        one tenant's flood cannot starve another. With one tenant this is plain FCFS."""
        queues: dict[str, deque[Sequence]] = {}
        for seq in self.waiting:
            queues.setdefault(seq.tenant, deque()).append(seq)
        if len(queues) <= 1:
            return list(self.waiting)
        position = {id(seq): i for i, seq in enumerate(self.waiting)}
        load = Counter(seq.tenant for seq in self.running)
        order: list[Sequence] = []
        while queues:
            tenant = min(queues, key=lambda t: (load[t], position[id(queues[t][0])]))
            order.append(queues[tenant].popleft())
            load[tenant] += 1
            if not queues[tenant]:
                del queues[tenant]
        return order

    def _expire_waiting(self, out: SchedulerOutput, now: float) -> None:
        """SLO-aware early abort: a request never scheduled is dropped once past its deadline,
        before it costs any compute (the engine reports it as aborted). A preempted request
        waits for its turn again whatever its deadline: it has started, and may have streamed
        tokens already."""
        expired = [s for s in self.waiting if s.deadline is not None and s.deadline <= now
                   and s.first_scheduled is None]
        for seq in expired:
            self.waiting.remove(seq)
            seq.status = SeqStatus.FINISHED
        out.expired.extend(expired)

    def _admit_waiting(self, out: SchedulerOutput, budget: int, now: float) -> None:
        adapters = self._adapters_running()
        admitted: list[Sequence] = []
        for seq in self._fair_order():
            if budget <= 0 or len(self.running) >= self.limits.max_num_seqs:
                break
            if not seq.adapter_ready or not seq.grammar_ready:
                continue
            new_adapter = seq.adapter is not None and seq.adapter not in adapters
            if new_adapter and len(adapters) >= self.limits.max_adapters_per_batch:
                continue  # grouping: let requests for adapters already in the batch go first
            hits = self._cached_prefix(seq)
            cached = len(hits) * self.limits.block_size
            n = min(seq.num_tokens - cached, budget)
            blocks = self.blocks_for(cached + n) - len(hits)
            # Cold hits stop being reclaimable once taken: count them as pages needed.
            need = blocks + self.pool.num_cold(hits)
            if seq.adapter is not None:
                if not self.pool.can_admit_adapter(seq.adapter, seq.adapter_pages, need):
                    break  # first come, first served on memory: do not starve big requests
            elif not self.pool.can_allocate(need):
                break
            self._admit(seq, n, blocks, hits, out)
            if seq.first_scheduled is None:
                seq.first_scheduled = now
            admitted.append(seq)
            if seq.adapter is not None:
                adapters.add(seq.adapter)
            budget -= n
        for seq in admitted:
            self.waiting.remove(seq)

    def _prefetch(self, out: SchedulerOutput) -> None:
        """Make the adapters of the next waiting requests resident (idle, so evictable) while
        free pages allow, so their copies overlap this step instead of delaying a later one.
        Runs last: nothing later in this step can evict what it places."""
        for seq in list(self.waiting)[: self.limits.prefetch_depth]:
            key = seq.adapter
            if key is None or not seq.adapter_ready or self.pool.is_resident(key):
                continue
            if seq.adapter_pages > self.pool.num_free or not self.pool.has_free_slot():
                break
            rec, _, evicted = self.pool.acquire_adapter(key, seq.adapter_pages)
            self.pool.release_adapter(key)
            out.evicted.extend(evicted)
            out.new_adapters.append(rec)

    def _admit(self, seq: Sequence, n: int, blocks: int, hits: list[int],
               out: SchedulerOutput) -> None:
        # The hits first: taken, they cannot be evicted for the adapter or the new pages.
        self.pool.take_cached(hits)
        cached = len(hits) * self.limits.block_size
        if self.limits.prefix_caching and seq.cache_identity is not None:
            self.stats.prefix_cache_queries += seq.num_tokens
            self.stats.prefix_cache_hits += cached
        if seq.first_scheduled is None:
            seq.num_cached_tokens = cached
        if seq.adapter is not None:
            rec, is_new, evicted = self.pool.acquire_adapter(seq.adapter, seq.adapter_pages)
            out.evicted.extend(evicted)
            if is_new:
                out.new_adapters.append(rec)
        pages, evicted = self.pool.allocate(blocks)
        out.evicted.extend(evicted)
        seq.block_table = hits + pages
        seq.num_computed_tokens = cached
        seq.num_registered_blocks = len(hits)
        seq.status = SeqStatus.RUNNING
        self.running.append(seq)
        out.scheduled.append(ScheduledSeq(seq, n, self._slot(seq)))

    # ---- after a step --------------------------------------------------------------------
    def postprocess(self, scheduled: list[ScheduledSeq],
                    sampled: list[tuple[Sequence, int | None]]) -> list[str | None]:
        """Book a step that ran: every scheduled chunk counts as computed, then each sequence of
        `sampled` gets its token (see `append_token`). Returns their finish reasons in order."""
        if scheduled:
            self._count_step(scheduled)
        for item in scheduled:
            item.seq.num_computed_tokens += item.num_new_tokens
            if self.limits.prefix_caching and item.seq.status is SeqStatus.RUNNING:
                self._register_full_blocks(item.seq)
        return [self.append_token(seq, token_id) for seq, token_id in sampled]

    # ---- prefix cache --------------------------------------------------------------------
    def _cached_prefix(self, seq: Sequence) -> list[int]:
        """The pool's pages for the longest cached run of `seq`'s full pages, leaving at least
        its last token to compute (its logits are sampled). None for a sequence that has
        computed tokens already, or wants prompt logprobs (those are computed, not cached)."""
        if (not self.limits.prefix_caching or seq.cache_identity is None
                or seq.num_computed_tokens or seq.params.prompt_logprobs is not None):
            return []
        full = (seq.num_tokens - 1) // self.limits.block_size
        return self.pool.match(self._block_hashes(seq, full)) if full else []

    def _block_hashes(self, seq: Sequence, n: int) -> list[bytes]:
        """The content hashes of `seq`'s first `n` full pages (fewer if a token there is still
        a placeholder), extended as the sequence grows and kept on it."""
        hashes, bs = seq.block_hashes, self.limits.block_size
        assert seq.cache_identity is not None
        while len(hashes) < n:
            i = len(hashes)
            tokens = seq.token_slice(i * bs, (i + 1) * bs)
            if PLACEHOLDER in tokens:
                break
            hashes.append(block_hash(hashes[-1] if hashes else b"", seq.cache_identity, tokens))
        return hashes[:n]

    def _register_full_blocks(self, seq: Sequence) -> None:
        """Offer the pool every page `seq` has filled (all its tokens computed) since the
        last step, under its content hash."""
        full = seq.num_computed_tokens // self.limits.block_size
        if full <= seq.num_registered_blocks or seq.cache_identity is None:
            return
        hashes = self._block_hashes(seq, full)
        for i in range(seq.num_registered_blocks, len(hashes)):
            self.pool.register(seq.block_table[i], hashes[i], seq.cache_identity)
        seq.num_registered_blocks = len(hashes)

    def _count_step(self, scheduled: list[ScheduledSeq]) -> None:
        stats = self.stats
        stats.steps += 1
        stats.last_tokens = sum(s.num_new_tokens for s in scheduled)
        stats.tokens += stats.last_tokens
        stats.last_distinct_adapters = len({s.seq.adapter for s in scheduled
                                            if s.seq.adapter is not None})
        stats.last_prefill_tokens = sum(s.num_new_tokens for s in scheduled
                                        if s.num_new_tokens > 1)

    def append_token(self, seq: Sequence, token_id: int | None) -> str | None:
        """Give `seq` its sampled token; when a stop token, EOS, `max_new_tokens` or
        `max_model_len` ends it, finish it (its pages are freed) and return the finish reason.
        `PLACEHOLDER`: the id is still on the device (asynchronous steps), no decision is made
        until `resolve`. None: no token (the step's logits were not usable)."""
        if token_id is None:
            return None
        seq.output_token_ids.append(token_id)
        if token_id == PLACEHOLDER:
            return None
        reason = self._finish_reason(seq, token_id)
        if reason is not None:
            self.finish(seq)
        return reason

    def resolve(self, seq: Sequence, token_id: int | None) -> str | None:
        """The id behind `seq`'s placeholder (its last token) has reached the host."""
        seq.output_token_ids.pop()
        return self.append_token(seq, token_id)

    def _finish_reason(self, seq: Sequence, token_id: int) -> str | None:
        p, n = seq.params, len(seq.output_token_ids)
        if n >= p.min_new_tokens and (
                token_id in p.stop_token_ids
                or (not p.ignore_eos and token_id in self.eos_token_ids)):
            return "stop"
        max_len = self.limits.max_model_len
        if n >= p.max_new_tokens or (max_len is not None and seq.num_tokens >= max_len):
            return "length"
        return None
