"""Host-side arrays of one step, built with numpy (no per-token Python loop), then moved to the
device in one pinned, non-blocking copy."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from slora_core.page_pool import PagePool
from slora_core.scheduler import ScheduledSeq


@dataclass(frozen=True)
class StepInputs:
    input_ids: np.ndarray  # [T] int64
    positions: np.ndarray  # [T] int64
    slot_mapping: np.ndarray  # [T] int64
    token_slots: np.ndarray  # [T] int64: adapter slot per token, -1 = base model
    seq_lens: np.ndarray  # [B] int64
    query_starts: np.ndarray  # [B + 1] int64
    block_tables: np.ndarray  # [B, max_blocks] int64
    logits_indices: np.ndarray  # [n] int64
    max_query_len: int

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.shape[0])

    @property
    def num_seqs(self) -> int:
        return int(self.seq_lens.shape[0])


def build_step_inputs(scheduled: list[ScheduledSeq], pool: PagePool, block_size: int
                      ) -> StepInputs:
    ids, pos, slots, adapters = [], [], [], []
    lens = np.empty(len(scheduled), dtype=np.int64)
    counts = np.empty(len(scheduled), dtype=np.int64)
    samples = np.empty(len(scheduled), dtype=bool)
    max_blocks = max(len(s.seq.block_table) for s in scheduled)
    tables = np.zeros((len(scheduled), max_blocks), dtype=np.int64)
    for i, item in enumerate(scheduled):
        seq, n = item.seq, item.num_new_tokens
        start = seq.num_computed_tokens
        p = np.arange(start, start + n, dtype=np.int64)
        table = np.asarray(seq.block_table, dtype=np.int64)
        tables[i, : len(table)] = table
        toks = seq.token_slice(start, start + n)
        ids.append(np.asarray(toks, dtype=np.int64))
        pos.append(p)
        slots.append(table[p // block_size] * block_size + p % block_size)
        rec = pool.resident(seq.adapter) if seq.adapter is not None else None
        adapters.append(np.full(n, rec.slot if rec is not None else -1, dtype=np.int64))
        lens[i] = start + n
        counts[i] = n
        samples[i] = item.samples
    starts = np.zeros(len(scheduled) + 1, dtype=np.int64)
    np.cumsum(counts, out=starts[1:])
    return StepInputs(
        input_ids=np.concatenate(ids), positions=np.concatenate(pos),
        slot_mapping=np.concatenate(slots), token_slots=np.concatenate(adapters),
        seq_lens=lens, query_starts=starts, block_tables=tables,
        logits_indices=starts[1:][samples] - 1, max_query_len=int(counts.max()),
    )


def to_device(arrays: list[np.ndarray], device: torch.device) -> list[torch.Tensor]:
    """Pack several 1-D/2-D integer arrays into one int64 host buffer, copy it once (pinned,
    non-blocking on CUDA), and return int64 device views shaped like the inputs."""
    flat = np.concatenate([a.reshape(-1) for a in arrays]) if arrays else np.zeros(0)
    host = torch.from_numpy(np.ascontiguousarray(flat, dtype=np.int64))
    if device.type == "cuda":
        host = host.pin_memory()
    dev = host.to(device=device, dtype=torch.int64, non_blocking=True)
    out, offset = [], 0
    for a in arrays:
        out.append(dev[offset : offset + a.size].view(a.shape))
        offset += a.size
    return out
