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
    # A CUDA stream (DecodeGraphs.fork_shrink): each LoRA projection's shrinks run on it
    # beside the base GEMM (they read only x), the expands after both; None: in line.
    lora_side: torch.cuda.Stream | None = None


@dataclass(frozen=True)
class PendingExpand:
    """A sole-adapter ride projection's expand (slora_core/lora_ride.py), left for the op that
    reads the projection's output to fuse in: out += s @ b_t, s [T, modules * rank]."""

    out: torch.Tensor  # the projection's [T, N] output (a strided view)
    s: torch.Tensor  # [T, modules * rank]: x @ A.T of each module, side by side
    b_t: torch.Tensor  # [modules * rank, N], block-diagonal, scale folded in
    rank: int  # rows per module

    def apply(self) -> None:
        """The expand as its own launch (the consumer could not fuse it)."""
        self.out.addmm_(self.s, self.b_t)


_CONTEXT: StepContext | None = None
# Expands deferred in the current step, by their output's data pointer (defer_expand).
_PENDING: dict[int, PendingExpand] = {}


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
    except BaseException:
        _PENDING.clear()
        raise
    finally:
        _CONTEXT = prev
    if _PENDING:
        left = len(_PENDING)
        _PENDING.clear()
        raise RuntimeError(f"{left} deferred LoRA expand(s) were never taken by their consumer "
                           "op: the step's outputs lack the adapter's delta")


def defer_expand(pending: PendingExpand) -> None:
    """Leave `pending` for the op that reads `pending.out` (take_expand); the step context
    raises on exit if none took it."""
    _PENDING[pending.out.data_ptr()] = pending


def take_expand(t: torch.Tensor) -> PendingExpand | None:
    """The expand deferred on the projection output `t` starts at (same first element, rows
    and row stride: a one-row view may carry any), removed from the step's pending ones; None
    when there is none."""
    pending = _PENDING.get(t.data_ptr()) if _PENDING else None
    if pending is None or pending.out.shape[0] != t.shape[0] \
            or (t.shape[0] > 1 and pending.out.stride(0) != t.stride(0)):
        return None
    return _PENDING.pop(t.data_ptr())
