"""A request's state inside the engine: tokens, KV blocks, adapter, progress."""

from __future__ import annotations

import enum
from collections.abc import Hashable
from dataclasses import dataclass, field

from slora_core.sampling_params import SamplingParams


class SeqStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(eq=False)
class Sequence:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    adapter: Hashable | None = None  # adapter pool key (its content digest); None = base model
    adapter_name: str | None = None  # the name the request asked for (what outputs report)
    adapter_pages: int = 0  # arena pages the adapter needs once resident
    adapter_ready: bool = True  # False while its weights are still loading into host memory
    grammar_ready: bool = True  # False while its structured-output grammar compiles
    tenant: str = ""
    arrival: float = 0.0
    deadline: float | None = None  # time.monotonic() by which it must have started, or dropped
    output_token_ids: list[int] = field(default_factory=list)
    block_table: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    status: SeqStatus = SeqStatus.WAITING
    num_preemptions: int = 0
    first_scheduled: float | None = None  # when the scheduler first admitted it
    # Prefix caching (slora_core.prefix_cache): what computed this sequence's KV (None: not
    # cached), its full pages' content hashes as far as computed, how many of its pages are
    # registered in the pool, and the prompt tokens found cached when it was first admitted.
    cache_identity: bytes | None = None
    block_hashes: list[bytes] = field(default_factory=list)
    num_registered_blocks: int = 0
    num_cached_tokens: int = 0

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def num_uncomputed(self) -> int:
        return self.num_tokens - self.num_computed_tokens

    def token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    def token_slice(self, start: int, end: int) -> list[int]:
        """token_ids()[start:end] without building the whole list (decode reads one token)."""
        p = len(self.prompt_token_ids)
        if end <= p:
            return self.prompt_token_ids[start:end]
        if start >= p:
            return self.output_token_ids[start - p : end - p]
        return self.prompt_token_ids[start:] + self.output_token_ids[: end - p]

    def token_at(self, i: int) -> int:
        p = len(self.prompt_token_ids)
        return self.prompt_token_ids[i] if i < p else self.output_token_ids[i - p]
