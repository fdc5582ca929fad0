"""Sharded layers that wrap the model's own: the model file never mentions tensor parallelism
(as it never mentions LoRA). `parallelize_vocab` swaps the embedding and LM head for
vocabulary-parallel ones; `parallelize_rows` sums the o and down projections (LoRA wrapper
included) over the ranks."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from slora_core.model import LlamaForCausalLM
from slora_core.tp.group import TPGroup


class VocabParallelEmbedding(nn.Module):
    """Embedding rows [start, start + local) on this rank; other ids give zeros here and their
    rows come from the rank holding them (all-reduce)."""

    def __init__(self, local: nn.Embedding, start: int, group: TPGroup) -> None:
        super().__init__()
        self.local = local
        self.start = start
        self.group = group

    @property
    def weight(self) -> torch.Tensor:
        return self.local.weight

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        local_ids = ids - self.start
        outside = (local_ids < 0) | (local_ids >= self.local.num_embeddings)
        out = F.embedding(local_ids.masked_fill(outside, 0), self.local.weight)
        out.masked_fill_(outside.unsqueeze(-1), 0.0)
        return self.group.all_reduce(out)


class VocabParallelHead(nn.Module):
    """LM head rows of this rank's vocabulary slice; logits gathered to every rank."""

    def __init__(self, local: nn.Linear, group: TPGroup) -> None:
        super().__init__()
        self.local = local
        self.group = group

    @property
    def weight(self) -> torch.Tensor:
        return self.local.weight

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.group.all_gather_cat(self.local(hidden), dim=-1)


class RowParallel(nn.Module):
    """Sums a row-parallel layer's partial outputs over the ranks. Wraps the LoRA wrapper, so
    the adapters' partial deltas ride on the base layer's all-reduce."""

    def __init__(self, inner: nn.Module, group: TPGroup) -> None:
        super().__init__()
        self.inner = inner
        self.group = group

    @property
    def weight(self) -> torch.Tensor:
        weight = self.inner.weight
        assert isinstance(weight, torch.Tensor)
        return weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.group.all_reduce(self.inner(x))


def parallelize_vocab(model: LlamaForCausalLM, vocab_start: int, group: TPGroup) -> None:
    """Replace the embedding and LM head (local vocabulary slices) by vocab-parallel ones."""
    embed, head = model.model.embed_tokens, model.lm_head
    model.model.embed_tokens = VocabParallelEmbedding(embed, vocab_start, group)  # type: ignore[assignment]
    model.lm_head = VocabParallelHead(head, group)  # type: ignore[assignment]


def parallelize_rows(model: LlamaForCausalLM, group: TPGroup) -> None:
    """Sum o_proj and down_proj over the ranks. Call after `wrap_lora`."""
    for layer in model.model.layers:
        for parent, name in ((layer.get_submodule("self_attn"), "o_proj"),
                             (layer.get_submodule("mlp"), "down_proj")):
            setattr(parent, name, RowParallel(getattr(parent, name), group))
