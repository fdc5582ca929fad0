"""The model runner of a tensor-parallel rank: rank 0 broadcasts each step's inputs (with the
arena changes that precede it) and every rank runs its shard on them.

Per step rank 0 sends, in this order: a fixed-size int64 header (flags, the flat buffer's
length, the step's `StepShape`), the arena ops when there are any (pickled: rare), and the
step's arrays packed in one int64 buffer (`step_arrays`). The header and the buffer are
broadcast as tensors on the device, so on NCCL rank 0 never waits for the host and the other
ranks get their step inputs without a host-to-device copy; rank 0 runs its own shard on the very
buffer it sent."""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import astuple, dataclass, field, fields
from typing import Any

import numpy as np
import torch

from slora_core.context import step_context
from slora_core.model_runner import ModelRunner
from slora_core.scheduler import ScheduledSeq
from slora_core.step_inputs import (
    StepShape,
    TokenPatch,
    build_step_inputs,
    pack_to_device,
    step_arrays,
)
from slora_core.tp.group import TPGroup

# An arena or adapter-store change, applied by every rank in rank 0's order:
# ("clear", slot) | ("write", slot, pages, digest) | ("register", name, path, digest)
# | ("add", name, LoraAdapter) | ("unregister", name) | ("forget", digest)
ArenaOp = tuple[Any, ...]

_STOP, _OPS, _STEP = 1, 2, 4
log = logging.getLogger(__name__)
HEADER_LEN = 2 + len(fields(StepShape))


@dataclass
class StepMessage:
    """What a rank > 0 receives before each step; `stop`: the engine shuts down."""

    ops: list[ArenaOp] = field(default_factory=list)
    shape: StepShape | None = None
    flat: torch.Tensor | None = None  # the step's arrays, on this rank's device
    stop: bool = False


class TPModelRunner(ModelRunner):
    """Every step runs eagerly on every rank (no CUDA graphs: see slora_core.tp.engine)."""

    def __init__(self, runner: ModelRunner, group: TPGroup) -> None:
        super().__init__(runner.model, runner.arena, use_cuda_graphs=False)
        self.group = group
        self.pending_ops: list[ArenaOp] = []  # rank 0: changes not yet sent
        # The worker's engine core changes adapters from other threads; a change and its
        # record happen under this lock, so records keep the order changes took effect in.
        self.ops_lock = threading.RLock()
        # Rank 0's host seconds spent sending each step (benchmarks read it).
        self.send_seconds: list[float] = []

    def record(self, op: ArenaOp) -> None:
        with self.ops_lock:
            self.pending_ops.append(op)

    @torch.inference_mode()
    def run(self, scheduled: list[ScheduledSeq], patch: TokenPatch | None = None
            ) -> torch.Tensor:
        """Rank 0: send the step to the other ranks, then run this rank's shard."""
        if patch is not None:
            raise RuntimeError("tensor-parallel steps take their input ids from the host")
        start = time.perf_counter()
        inputs = build_step_inputs(scheduled, self.arena.block_size)
        arrays, shape = step_arrays(inputs)
        with self.ops_lock:
            ops, self.pending_ops = self.pending_ops, []
        flat = pack_to_device(arrays, self.device)
        self.send(ops, shape, flat)
        self.send_seconds.append(time.perf_counter() - start)
        return self.forward(flat, shape)

    def send(self, ops: list[ArenaOp], shape: StepShape | None = None,
             flat: torch.Tensor | None = None, *, stop: bool = False) -> None:
        """Rank 0: one message (see the module docstring)."""
        flags = (_STOP if stop else 0) | (_OPS if ops else 0) | (_STEP if shape else 0)
        numel = 0 if flat is None else flat.numel()
        sizes = astuple(shape) if shape is not None else (0,) * (HEADER_LEN - 2)
        header = pack_to_device([np.array([flags, numel, *sizes], dtype=np.int64)],
                                self.device)
        if ops or stop:  # rare: adapter changes, shutdown
            log.debug("rank 0: sending %d ops %s%s", len(ops), [op[0] for op in ops][:16],
                      " and stop" if stop else "")
        self.group.broadcast_tensor(header)
        if ops:
            self.group.broadcast(ops)
        if flat is not None:
            self.group.broadcast_tensor(flat)

    def receive(self) -> StepMessage:
        """Rank > 0: rank 0's next message."""
        header = torch.empty(HEADER_LEN, dtype=torch.int64, device=self.device)
        flags, numel, *sizes = self.group.broadcast_tensor(header).tolist()
        if flags & _STOP:
            return StepMessage(stop=True)
        ops = self.group.broadcast(None) if flags & _OPS else []
        if not flags & _STEP:
            return StepMessage(ops=ops)
        flat = torch.empty(numel, dtype=torch.int64, device=self.device)
        return StepMessage(ops=ops, shape=StepShape(*sizes),
                           flat=self.group.broadcast_tensor(flat))

    @torch.inference_mode()
    def forward(self, flat: torch.Tensor, shape: StepShape) -> torch.Tensor:
        """Every rank: this shard's forward; float32 logits [n, vocab] (gathered)."""
        input_ids, ctx = self.context_from(flat, shape)
        with step_context(ctx):
            hidden = self.model(input_ids, ctx.positions)
            return self.model.compute_logits(hidden[ctx.logits_indices])
