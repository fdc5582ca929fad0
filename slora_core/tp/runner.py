"""The model runner of a tensor-parallel rank: rank 0 broadcasts each step's inputs (with the
arena changes that precede it) and every rank runs its shard on them."""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Any

import torch

from slora_core.context import step_context
from slora_core.model_runner import ModelRunner
from slora_core.scheduler import ScheduledSeq
from slora_core.step_inputs import StepInputs, TokenPatch, build_step_inputs
from slora_core.tp.group import TPGroup

# An arena or adapter-store change, applied by every rank in rank 0's order:
# ("clear", slot) | ("write", slot, pages, name) | ("register", name, path, sha256)
# | ("add", name, LoraAdapter) | ("unregister", name)
ArenaOp = tuple[Any, ...]


@dataclass
class StepMessage:
    """What rank 0 sends before each step; `inputs=None` with `stop`: the engine shuts down."""

    ops: list[ArenaOp] = field(default_factory=list)
    inputs: StepInputs | None = None
    stop: bool = False


class TPModelRunner(ModelRunner):
    """Eager steps only: CUDA graphs with NCCL collectives inside are not built yet."""

    def __init__(self, runner: ModelRunner, group: TPGroup) -> None:
        super().__init__(runner.model, runner.arena, use_cuda_graphs=False)
        self.group = group
        self.pending_ops: list[ArenaOp] = []  # rank 0: changes not yet sent
        # The worker's engine core changes adapters from other threads; a change and its
        # record happen under this lock, so records keep the order changes took effect in.
        self.ops_lock = threading.RLock()

    def record(self, op: ArenaOp) -> None:
        with self.ops_lock:
            self.pending_ops.append(op)

    def run(self, scheduled: list[ScheduledSeq], patch: TokenPatch | None = None
            ) -> torch.Tensor:
        """Rank 0: send the step to the other ranks, then run this rank's shard."""
        if patch is not None:
            raise RuntimeError("tensor-parallel steps take their input ids from the host")
        inputs = build_step_inputs(scheduled, self.arena.block_size)
        with self.ops_lock:
            ops, self.pending_ops = self.pending_ops, []
        self.group.broadcast(StepMessage(ops=ops, inputs=inputs))
        return self.forward(inputs)

    @torch.inference_mode()
    def forward(self, inputs: StepInputs) -> torch.Tensor:
        """Every rank: this shard's forward; float32 logits [n, vocab] (gathered)."""
        input_ids, ctx = self.build_context(inputs)
        with step_context(ctx):
            hidden = self.model(input_ids, ctx.positions)
            return self.model.compute_logits(hidden[ctx.logits_indices])
