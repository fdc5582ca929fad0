"""Per-step batch metadata, built once per engine step and read by every layer.

The flattened batch holds T tokens from B sequences (prefill chunks and decode tokens alike),
ordered so that sequences sharing an adapter are adjacent (LoRA segments). Layers read the
current step's context through `get_context()` (the nano-vllm pattern), so model code keeps a
plain `forward(input_ids, positions)` signature.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch

from slora_kernels.lora_meta import LoraMeta


@dataclass(frozen=True)
class LoraTables:
    """Offset tables of resident adapters, laid out [num_layers, num_slots, num_modules]."""

    arena: torch.Tensor  # 1-D view of the whole page arena
    a_offsets: torch.Tensor  # int64
    b_offsets: torch.Tensor  # int64
    ranks: torch.Tensor  # int32, 0 = module not targeted / slot empty
    scales: torch.Tensor  # float32
    max_rank: int = 0  # host-side bound on every rank (spares kernels a host sync); 0 = unknown


@dataclass(frozen=True)
class StepContext:
    positions: torch.Tensor  # [T] int64
    slot_mapping: torch.Tensor  # [T] int64: arena KV row (page * block_size + offset)
    block_tables: torch.Tensor  # [B, max_blocks] int32
    seq_lens: torch.Tensor  # [B] int32: context length after this step's tokens
    query_starts: torch.Tensor  # [B + 1] int32
    max_query_len: int
    max_seq_len: int
    logits_indices: torch.Tensor  # [n] int64: tokens whose next-token logits are needed
    kv_caches: tuple[tuple[torch.Tensor, torch.Tensor], ...]  # per layer (k, v) arena views
    lora: LoraMeta | None = None
    lora_tables: LoraTables | None = None
    # Module ids (config.MODULE_INDEX) that some resident adapter targets; LoRA launches for
    # the others are skipped. None = all modules.
    lora_modules: frozenset[int] | None = None
    # EngineConfig.lora_pdl: each LoRA expand launched as a programmatic dependent of its
    # shrink (Hopper+); None = the kernels' default (slora_kernels.lora.LoraTiles.pdl).
    lora_pdl: bool | None = None
    # Every row reads the adapter loaded in the projections' ride rows (lora_ride.py): they
    # run LoraLinear.ride instead of the kernels (`lora` and `lora_tables` unused).
    lora_ride: bool = False


_CONTEXT: StepContext | None = None


def get_context() -> StepContext:
    if _CONTEXT is None:
        raise RuntimeError("no step context is set: call the model inside `step_context(...)`")
    return _CONTEXT


@contextmanager
def step_context(ctx: StepContext) -> Iterator[StepContext]:
    global _CONTEXT
    prev, _CONTEXT = _CONTEXT, ctx
    try:
        yield ctx
    finally:
        _CONTEXT = prev
