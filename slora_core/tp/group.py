"""The process group of a tensor-parallel engine: the few collectives the sharded model and the
step broadcast need, over `torch.distributed` (gloo on CPU, NCCL on CUDA)."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class TPGroup:
    """This process's place in the default process group. Size 1 makes every collective the
    identity, so a sharded layer also runs unsharded."""

    rank: int
    size: int

    @classmethod
    def join(cls, rank: int, size: int, init_method: str, device: str,
             timeout_s: float = 600.0) -> TPGroup:
        """Join the group of `size` ranks meeting at `init_method` (e.g. file:///tmp/x)."""
        backend = "nccl" if torch.device(device).type == "cuda" else "gloo"
        dist.init_process_group(backend, init_method=init_method, rank=rank, world_size=size,
                                timeout=timedelta(seconds=timeout_s))
        return cls(rank, size)

    def leave(self) -> None:
        if dist.is_initialized():
            dist.destroy_process_group()

    def all_reduce(self, t: torch.Tensor) -> torch.Tensor:
        """Sum `t` over the ranks, in place."""
        if self.size > 1:
            dist.all_reduce(t)
        return t

    def all_gather_cat(self, t: torch.Tensor, dim: int) -> torch.Tensor:
        """Every rank's `t` (same shape everywhere), concatenated along `dim` in rank order."""
        if self.size == 1:
            return t
        t = t.contiguous()
        parts = [torch.empty_like(t) for _ in range(self.size)]
        dist.all_gather(parts, t)
        return torch.cat(parts, dim=dim)

    def broadcast(self, obj: Any) -> Any:
        """Rank 0's `obj` (pickled), on every rank; other ranks' argument is ignored."""
        if self.size == 1:
            return obj
        box = [obj]
        dist.broadcast_object_list(box, src=0)
        return box[0]
