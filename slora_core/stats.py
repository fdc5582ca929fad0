"""Counters an engine keeps and the snapshot a server reports: plain data, no torch."""

from __future__ import annotations

from dataclasses import dataclass, fields


@dataclass
class EngineStats:
    """Counted by the scheduler (steps, tokens, preemptions, evictions) and the adapter tiers
    (loads and where they came from)."""

    steps: int = 0
    tokens: int = 0
    preemptions: int = 0
    adapter_loads: int = 0  # adapters copied into arena pages
    adapter_evictions: int = 0
    # Where each of adapter_loads came from: the host tier, or a disk read in that step.
    adapter_host_hits: int = 0
    adapter_disk_loads: int = 0
    # Adapters read from disk in the background for requests that found them in no tier (their
    # arena loads then count as host hits).
    adapter_background_reads: int = 0
    last_distinct_adapters: int = 0
    # The last step's tokens, and those of its chunks longer than one token (prompt chunks):
    # 0 for a decode-only step.
    last_tokens: int = 0
    last_prefill_tokens: int = 0
    # Prefix caching, in tokens as vLLM's vllm:prefix_cache_queries / _hits count them: the
    # tokens of sequences admitted, and those of them found cached (not computed).
    prefix_cache_queries: int = 0
    prefix_cache_hits: int = 0
    prefix_evictions: int = 0  # cold prefix pages evicted (adapter_evictions: adapters)

    def reset(self) -> None:
        """Every counter back to zero (a benchmark's window starts)."""
        for f in fields(self):
            setattr(self, f.name, f.default)


@dataclass
class EngineSnapshot:
    running: int
    waiting: int
    kv_pages: int
    adapter_pages: int
    free_pages: int
    adapter_loads: int
    adapter_evictions: int
    steps: int
    running_adapters: list[str]
    waiting_adapters: list[str]
    # EngineConfig.merge_sole_adapter: adapters folded into the base weights, steps run so.
    adapter_merges: int = 0
    merged_steps: int = 0
