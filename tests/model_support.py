"""Model helpers behind tests/conftest.py's fixtures (imported when a fixture is used, so the
xdist controller, which runs no test, does not import torch): the paged-KV harness that drives
our model one engine step at a time through a hand-built StepContext, and seeded random
Hugging Face checkpoints."""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import torch

from slora_core.config import ModelConfig
from slora_core.context import StepContext, step_context
from slora_core.model import LlamaForCausalLM


class PagedKV:
    """A page arena in the DESIGN section 3 layout plus block tables for a few sequences.

    Pages are handed out in a shuffled order, so every block table is non-contiguous. The arena
    starts as NaN (float dtypes): reading a KV row that was never written poisons the output.
    """

    def __init__(self, config: ModelConfig, dtype: torch.dtype = torch.float32,
                 num_pages: int = 64, block_size: int = 4, seed: int = 0,
                 device: torch.device | str = "cpu") -> None:
        self.block_size = block_size
        self.device = torch.device(device)
        layers, kv_heads, head_dim = (config.num_hidden_layers, config.num_key_value_heads,
                                      config.head_dim)
        page_numel = block_size * layers * 2 * kv_heads * head_dim
        self.arena = torch.full((num_pages, page_numel), float("nan"), dtype=dtype,
                                device=self.device)
        pages = self.arena.view(num_pages, layers, 2, block_size, kv_heads, head_dim)
        self.kv_caches = tuple((pages[:, i, 0], pages[:, i, 1]) for i in range(layers))
        self.free = list(range(num_pages))
        random.Random(seed).shuffle(self.free)
        self.tables: list[list[int]] = []
        self.lens: list[int] = []

    def add_sequence(self) -> int:
        self.tables.append([])
        self.lens.append(0)
        return len(self.tables) - 1

    def build_context(self, chunks: dict[int, list[int]]) -> tuple[StepContext, torch.Tensor]:
        """Append chunks[seq] to each listed sequence; return the step's context and input ids."""
        ids, positions, slots, seq_lens, starts, tables = [], [], [], [], [0], []
        for seq, tokens in chunks.items():
            start = self.lens[seq]
            end = start + len(tokens)
            while len(self.tables[seq]) * self.block_size < end:
                self.tables[seq].append(self.free.pop())
            for pos in range(start, end):
                page = self.tables[seq][pos // self.block_size]
                slots.append(page * self.block_size + pos % self.block_size)
            ids += tokens
            positions += range(start, end)
            seq_lens.append(end)
            starts.append(starts[-1] + len(tokens))
            tables.append(self.tables[seq])
            self.lens[seq] = end
        width = max(len(t) for t in tables)
        padded = [t + [0] * (width - len(t)) for t in tables]
        def tensor(values: list[int] | list[list[int]], dtype: torch.dtype) -> torch.Tensor:
            return torch.tensor(values, dtype=dtype, device=self.device)

        ctx = StepContext(
            positions=tensor(positions, torch.int64),
            slot_mapping=tensor(slots, torch.int64),
            block_tables=tensor(padded, torch.int32),
            seq_lens=tensor(seq_lens, torch.int32),
            query_starts=tensor(starts, torch.int32),
            max_query_len=max(len(t) for t in chunks.values()),
            max_seq_len=max(seq_lens),
            logits_indices=torch.arange(len(ids), dtype=torch.int64, device=self.device),
            kv_caches=self.kv_caches,
        )
        return ctx, tensor(ids, torch.int64)

    @torch.no_grad()
    def step(self, model: LlamaForCausalLM, chunks: dict[int, list[int]]
             ) -> dict[int, torch.Tensor]:
        """Run one engine step; return each listed sequence's logits [len(chunk), vocab]."""
        ctx, ids = self.build_context(chunks)
        with step_context(ctx):
            hidden = model(ids, ctx.positions)
        logits = model.compute_logits(hidden[ctx.logits_indices])
        bounds = ctx.query_starts.tolist()
        return {seq: logits[bounds[i]:bounds[i + 1]] for i, seq in enumerate(chunks)}


# Small shapes that still exercise GQA (4 query heads over 2 KV heads) and a head_dim whose
# RoPE frequencies span all three llama3 bands.
TINY: dict[str, Any] = {
    "hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 2,
    "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 300,
    "max_position_embeddings": 256,
}


def randomize_(model: torch.nn.Module, seed: int) -> None:
    # HF's default init (std 0.02, zero biases, unit norms) would hide bias and norm bugs and
    # give near-uniform logits; unit-scale weights make every parameter matter.
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1.0 + 0.1 * torch.randn(p.shape, generator=gen))
            elif name.endswith(".bias"):
                p.copy_(0.5 * torch.randn(p.shape, generator=gen))
            elif p.dim() == 2 and "embed_tokens" not in name:
                p.copy_(torch.randn(p.shape, generator=gen) / p.shape[1] ** 0.5)
            else:
                p.copy_(torch.randn(p.shape, generator=gen))




def save_hf_checkpoint(folder: Path, model_type: str = "llama", max_shard_size: str | None = None,
                       seed: int = 0, **overrides: Any) -> tuple[Path, Any]:
    """A seeded random HF model (transformers' own classes) saved under `folder`."""
    import transformers

    config_cls, model_cls = {
        "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
        "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM),
        "mistral": (transformers.MistralConfig, transformers.MistralForCausalLM),
    }[model_type]
    config = config_cls(**{**TINY, **overrides})
    torch.manual_seed(seed)
    model = model_cls(config).eval()
    randomize_(model, seed)
    out = folder / f"{model_type}-{seed}-{len(list(folder.iterdir()))}"
    kwargs = {"max_shard_size": max_shard_size} if max_shard_size else {}
    model.save_pretrained(out, **kwargs)
    return out, model
