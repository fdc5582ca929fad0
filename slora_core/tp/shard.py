"""Which part of every weight one rank holds (Megatron-style).

Column-parallel (output rows split): q/k/v (by attention head), gate/up, the embedding and the
LM head (by vocabulary row). Row-parallel (input columns split, outputs summed over ranks): o and
down. Query heads split evenly; KV heads split evenly when there are at least as many as ranks,
else each rank keeps the one KV head its query heads read (replicated across ranks).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from slora_core.config import ConfigError, ModelConfig

COLUMN_PARALLEL = ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj")
ROW_PARALLEL = ("o_proj", "down_proj")


@dataclass(frozen=True)
class TPShard:
    """Rank `rank` of `size` over the model `full`."""

    full: ModelConfig
    rank: int
    size: int

    def __post_init__(self) -> None:
        c, n = self.full, self.size
        if not 0 <= self.rank < n:
            raise ConfigError(f"rank {self.rank} is outside a group of {n}")
        kv_ok = c.num_key_value_heads % n == 0 or n % c.num_key_value_heads == 0
        for what, value in (("num_attention_heads", c.num_attention_heads),
                            ("intermediate_size", c.intermediate_size),
                            ("vocab_size", c.vocab_size)):
            if value % n:
                raise ConfigError(f"tensor_parallel_size={n} does not divide {what}={value}")
        if not kv_ok:
            raise ConfigError(f"tensor_parallel_size={n} and num_key_value_heads="
                              f"{c.num_key_value_heads}: neither divides the other")

    @property
    def num_heads(self) -> int:
        return self.full.num_attention_heads // self.size

    @property
    def num_kv_heads(self) -> int:
        return max(self.full.num_key_value_heads // self.size, 1)

    @property
    def kv_head_start(self) -> int:
        hkv = self.full.num_key_value_heads
        if hkv >= self.size:
            return self.rank * (hkv // self.size)
        # Fewer KV heads than ranks: rank r's query heads all read KV head r*Hkv//n.
        return self.rank * hkv // self.size

    @property
    def vocab_start(self) -> int:
        return self.rank * self.local_vocab

    @property
    def local_vocab(self) -> int:
        return self.full.vocab_size // self.size

    def model_config(self) -> ModelConfig:
        """The shapes of this rank's model: local heads, MLP width and vocabulary slice."""
        return replace(self.engine_config(), vocab_size=self.local_vocab)

    def engine_config(self) -> ModelConfig:
        """What this rank's engine sees: local heads and MLP width (its page arena holds the
        local KV heads), the full vocabulary (logits are gathered)."""
        return replace(self.full, num_attention_heads=self.num_heads,
                       num_key_value_heads=self.num_kv_heads,
                       intermediate_size=self.full.intermediate_size // self.size)

    def module_range(self, module: str) -> tuple[int, int]:
        """[start, stop) of the split dimension of a LORA_MODULES layer on this rank: output
        rows for column-parallel layers, input columns for row-parallel ones."""
        d, r = self.full.head_dim, self.rank
        inter = self.full.intermediate_size // self.size
        if module in ("q_proj", "o_proj"):
            return r * self.num_heads * d, (r + 1) * self.num_heads * d
        if module in ("k_proj", "v_proj"):
            start = self.kv_head_start * d
            return start, start + self.num_kv_heads * d
        if module in ("gate_proj", "up_proj", "down_proj"):
            return r * inter, (r + 1) * inter
        raise ConfigError(f"unknown module {module!r}")

    def shard_lora(self, module: str, a: torch.Tensor, b: torch.Tensor
                   ) -> tuple[torch.Tensor, torch.Tensor]:
        """This rank's (A [r, in], B [out, r]) of a module's adapter weights. Column-parallel:
        B split by output rows, A whole. Row-parallel: A split by input columns, B whole, so
        the rank's partial delta B(A_k x_k) sums over ranks, inside the base layer's all-reduce,
        to B(A x): no extra communication."""
        start, stop = self.module_range(module)
        if module in ROW_PARALLEL:
            return a[:, start:stop].contiguous(), b
        return a, b[start:stop].contiguous()
