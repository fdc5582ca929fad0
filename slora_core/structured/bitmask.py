"""The grammar masks of one step, applied to the sampler's scores as one batched op.

The host fills an int32 [n, ceil(V / 32)] bitmask (one row per constrained request of the
batch); one copy takes it to the device, where it is unpacked and every disallowed token of
those rows is set to -inf. Unconstrained rows are untouched, so constrained, free, base and
adapter requests share the step (and the model's CUDA graph: this runs on the logits after it).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from slora_core.host_copy import row_index

_SHIFTS: dict[torch.device, torch.Tensor] = {}


@dataclass(frozen=True)
class GrammarMask:
    """`bitmask[i]` holds the tokens allowed in batch row `rows[i]` (bit t of word t // 32)."""

    bitmask: torch.Tensor  # int32 [len(rows), W], on the host
    rows: tuple[int, ...]

    def __post_init__(self) -> None:
        if self.bitmask.dim() != 2 or self.bitmask.shape[0] != len(self.rows):
            raise ValueError(f"bitmask of shape {tuple(self.bitmask.shape)} for "
                             f"{len(self.rows)} rows")


def new_bitmask(rows: int, vocab_size: int, pin: bool) -> torch.Tensor:
    """An int32 [rows, ceil(vocab_size / 32)] host bitmask (pinned for a CUDA copy)."""
    width = (vocab_size + 31) // 32
    return torch.empty(rows, width, dtype=torch.int32, pin_memory=pin)


def allowed_tokens(bitmask: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """[n, vocab_size] bool from an int32 [n, W] bitmask (on the bitmask's device); tokens past
    the mask's 32 * W are not allowed."""
    device = bitmask.device
    shifts = _SHIFTS.get(device)
    if shifts is None:
        shifts = _SHIFTS[device] = torch.arange(32, dtype=torch.int32, device=device)
    n, width = bitmask.shape
    bits = ((bitmask[:, :, None] >> shifts) & 1).bool().reshape(n, width * 32)
    if width * 32 >= vocab_size:
        return bits[:, :vocab_size]
    pad = torch.zeros(n, vocab_size - width * 32, dtype=torch.bool, device=device)
    return torch.cat([bits, pad], dim=1)


def apply_grammar_mask(scores: torch.Tensor, mask: GrammarMask | None) -> torch.Tensor:
    """`scores` [B, V] with the disallowed tokens of the constrained rows at -inf (a new
    tensor: the input may be the model's static output buffer). No host sync."""
    if mask is None or not mask.rows:
        return scores
    batch, vocab = scores.shape
    bits = mask.bitmask.to(scores.device, non_blocking=True)  # pinned (new_bitmask)
    allowed = allowed_tokens(bits, vocab)
    if len(mask.rows) == batch and mask.rows == tuple(range(batch)):
        return scores.masked_fill(~allowed, float("-inf"))
    rows = row_index(mask.rows, scores.device)  # pinned: pageable may wait for the stream
    masked = scores.index_select(0, rows).masked_fill(~allowed, float("-inf"))
    return scores.index_copy(0, rows, masked)
