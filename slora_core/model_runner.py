"""Turns a scheduled step into tensors (one StepContext), runs the model, returns the logits of
the sequences that sample this step. The only engine part that touches the device."""

from __future__ import annotations

import torch
from torch import nn

from kernels.lora_reference import LoraMeta
from slora_core.arena import PageArena
from slora_core.context import StepContext, step_context
from slora_core.page_pool import PagePool
from slora_core.scheduler import ScheduledSeq


class ModelRunner:
    def __init__(self, model: nn.Module, arena: PageArena, pool: PagePool) -> None:
        self.model = model
        self.arena = arena
        self.pool = pool
        self.device = arena.pages.device

    def build_context(self, scheduled: list[ScheduledSeq]) -> tuple[torch.Tensor, StepContext]:
        bs = self.arena.block_size
        input_ids: list[int] = []
        positions: list[int] = []
        slot_mapping: list[int] = []
        token_slots: list[int] = []
        query_starts = [0]
        seq_lens: list[int] = []
        logits_indices: list[int] = []
        for item in scheduled:
            seq, n = item.seq, item.num_new_tokens
            start = seq.num_computed_tokens
            rec = self.pool.resident(seq.adapter) if seq.adapter is not None else None
            slot = rec.slot if rec is not None else -1
            for pos in range(start, start + n):
                input_ids.append(seq.token_at(pos))
                positions.append(pos)
                slot_mapping.append(seq.block_table[pos // bs] * bs + pos % bs)
                token_slots.append(slot)
            query_starts.append(query_starts[-1] + n)
            seq_lens.append(start + n)
            if item.samples:
                logits_indices.append(query_starts[-1] - 1)
        max_blocks = max(len(s.seq.block_table) for s in scheduled)
        tables = [s.seq.block_table + [0] * (max_blocks - len(s.seq.block_table)) for s in scheduled]
        dev = self.device

        def i64(v: list[int]) -> torch.Tensor:
            return torch.tensor(v, dtype=torch.int64, device=dev)

        def i32(v: list[int] | list[list[int]]) -> torch.Tensor:
            return torch.tensor(v, dtype=torch.int32, device=dev)

        has_lora = any(s >= 0 for s in token_slots)
        ctx = StepContext(
            positions=i64(positions),
            slot_mapping=i64(slot_mapping),
            block_tables=i32(tables),
            seq_lens=i32(seq_lens),
            query_starts=i32(query_starts),
            max_query_len=max(s.num_new_tokens for s in scheduled),
            max_seq_len=max(seq_lens),
            logits_indices=i64(logits_indices),
            kv_caches=self.arena.kv_caches,
            lora=LoraMeta.from_token_slots(token_slots, dev) if has_lora else None,
            lora_tables=self.arena.tables if has_lora else None,
        )
        return i64(input_ids), ctx

    @torch.inference_mode()
    def run(self, scheduled: list[ScheduledSeq]) -> torch.Tensor:
        """Forward the step; float32 logits [num_sampling_seqs, vocab] in scheduled order."""
        input_ids, ctx = self.build_context(scheduled)
        with step_context(ctx):
            hidden = self.model(input_ids, ctx.positions)
            return self.model.compute_logits(hidden[ctx.logits_indices])
