"""The compute ops the model calls, bound to Triton kernels on CUDA and torch references
elsewhere. Everything device-specific the model needs goes through here."""

from __future__ import annotations

import torch

from kernels.attention_reference import paged_attention_reference, write_kv_reference
from kernels.lora_reference import LoraMeta, add_lora_reference


def _use_triton(t: torch.Tensor) -> bool:
    return t.is_cuda


def write_kv(k_cache: torch.Tensor, v_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
             slot_mapping: torch.Tensor) -> None:
    write_kv_reference(k_cache, v_cache, k, v, slot_mapping)


def paged_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                    block_tables: torch.Tensor, seq_lens: torch.Tensor,
                    query_starts: torch.Tensor, scale: float) -> torch.Tensor:
    return paged_attention_reference(q, k_cache, v_cache, block_tables, seq_lens, query_starts,
                                     scale)


def add_lora(y: torch.Tensor, x: torch.Tensor, arena: torch.Tensor, a_offsets: torch.Tensor,
             b_offsets: torch.Tensor, ranks: torch.Tensor, scales: torch.Tensor,
             module_ids: tuple[int, ...], out_slices: tuple[tuple[int, int], ...],
             meta: LoraMeta) -> None:
    add_lora_reference(y, x, arena, a_offsets, b_offsets, ranks, scales, module_ids, out_slices,
                       meta)
