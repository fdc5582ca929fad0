"""The process group of a tensor-parallel engine: the few collectives the sharded model and the
step broadcast need, over `torch.distributed` (gloo on CPU, NCCL on CUDA)."""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

# torch 2.13 renames all_gather_into_tensor (deprecated there); the H200 image has 2.11.
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
log = logging.getLogger(__name__)


@dataclass(frozen=True)
class TPGroup:
    """This process's place in the default process group. Size 1 makes every collective the
    identity, so a sharded layer also runs unsharded."""

    rank: int
    size: int

    @classmethod
    def join(cls, rank: int, size: int, init_method: str, device: str,
             timeout_s: float = 600.0) -> TPGroup:
        """Join the group of `size` ranks meeting at `init_method` (e.g. file:///tmp/x). On
        CUDA `device` must already be this process's current device (NCCL binds to it)."""
        dev = torch.device(device)
        kwargs: dict[str, Any] = {}
        if dev.type == "cuda":
            # Binding the group to its device lets NCCL set up its communicator now, once,
            # instead of at the first collective (and warns of nothing later).
            kwargs["device_id"] = dev
        dist.init_process_group("nccl" if dev.type == "cuda" else "gloo",
                                init_method=init_method, rank=rank, world_size=size,
                                timeout=timedelta(seconds=timeout_s), **kwargs)
        return cls(rank, size)

    def leave(self, timeout_s: float = 30.0) -> bool:
        """Leave the group, waiting at most `timeout_s`; False when the group could not be
        destroyed in that time (it is then left as it is: the caller should end the process).

        Every rank should leave at about the same time: NCCL's destroy flushes the collectives
        this rank started and waits for the other ranks' destroy, so it hangs for good when a
        rank died or a collective was never matched (torch >= 2.6 no longer aborts there)."""
        if not dist.is_initialized():
            return True
        done = threading.Event()

        def destroy() -> None:
            try:
                dist.destroy_process_group()
            except Exception:  # noqa: BLE001 (shutting down: report, go on)
                log.exception("rank %d: destroy_process_group failed", self.rank)
            done.set()

        threading.Thread(target=destroy, name="tp-leave", daemon=True).start()
        if done.wait(timeout_s):
            return True
        log.error("rank %d: the process group was not destroyed within %.0f s (a rank died "
                  "or a collective was left unmatched)", self.rank, timeout_s)
        return False

    def all_reduce(self, t: torch.Tensor) -> torch.Tensor:
        """Sum `t` over the ranks, in place, in its own dtype (fp16/bf16 activations are
        summed as they are: one rounding per rank's addend, as Megatron and vLLM do)."""
        if self.size > 1:
            dist.all_reduce(t)
        return t

    def all_gather_cat(self, t: torch.Tensor, dim: int) -> torch.Tensor:
        """Every rank's `t` (same shape everywhere), concatenated along `dim` in rank order."""
        if self.size == 1:
            return t
        t = t.contiguous()
        out = torch.empty((self.size * t.shape[0], *t.shape[1:]), dtype=t.dtype,
                          device=t.device)
        _all_gather_single(out, t)
        return out if dim == 0 else torch.cat(out.chunk(self.size), dim=dim)

    def broadcast_tensor(self, t: torch.Tensor) -> torch.Tensor:
        """Rank 0's `t` into every rank's `t` (same shape and dtype everywhere), in place, on
        the tensor's device: no host copy and, on CUDA, no host synchronisation."""
        if self.size > 1:
            dist.broadcast(t, src=0)
        return t

    def broadcast(self, obj: Any) -> Any:
        """Rank 0's `obj` (pickled), on every rank; other ranks' argument is ignored. Costs a
        host round trip on NCCL: for rare messages (adapter changes), not per-step data."""
        if self.size == 1:
            return obj
        box = [obj]
        dist.broadcast_object_list(box, src=0)
        return box[0]
