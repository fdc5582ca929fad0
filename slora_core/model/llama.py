"""Llama-family causal LM (Llama 2/3, Mistral without sliding window, Qwen2 q/k/v biases) over a
flattened batch: `forward(input_ids [T], positions [T]) -> hidden [T, hidden]`.

Module names mirror Hugging Face's except for the fused projections (`qkv_proj`,
`gate_up_proj`); `slora_core.weights` maps checkpoint tensors onto them.
"""

from __future__ import annotations

import torch
from torch import nn

from slora_core import ops
from slora_core.config import ModelConfig
from slora_core.model.layers import DecoderLayer, RMSNorm
from slora_core.model.rope import RotaryEmbedding


class LlamaModel(nn.Module):
    """Embedding, decoder layers and the final norm."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(config, i) for i in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.rotary_emb = RotaryEmbedding(config)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        x = self.embed_tokens(input_ids)
        cos, sin = self.rotary_emb(positions, x.dtype)
        cos, sin = cos.view(cos.shape[0], -1), sin.view(sin.shape[0], -1)
        residual = None
        for layer in self.layers:
            x, residual = layer(x, residual, cos, sin)
        return self.norm(x, residual)[0]


class LMHead(nn.Linear):
    """The LM head; its output is float32 logits whatever the model dtype. HF rounds a 16-bit
    model's logits to fp16/bf16, an error of up to half an ulp of each logit (0.004 at |logit|
    8-16 in fp16): the size of the margins that decide greedy near-ties. Here the GEMM's
    float32 accumulator is kept instead, which costs [tokens, vocab] float32 writes beside
    the [vocab, hidden] weight read (docs/numerics.md)."""

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return ops.linear_float32(hidden, self.weight)


class LlamaForCausalLM(nn.Module):
    """The decoder plus the LM head. Must run inside `slora_core.context.step_context(ctx)`,
    whose `kv_caches[i]` is layer i's (k, v) view of the page arena."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config
        self.model = LlamaModel(config)
        self.lm_head = LMHead(config.hidden_size, config.vocab_size, bias=False)
        self.tie_weights()

    def tie_weights(self) -> None:
        """Share the embedding matrix with the LM head when the config ties them. Call again
        after anything that replaces parameters (e.g. `to_empty`), which unties them."""
        if self.config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def reset_buffers(self) -> None:
        """Recompute non-persistent buffers (RoPE frequencies, float32) on their device."""
        self.model.rotary_emb.reset_parameters()

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """input_ids, positions: [T] int64 -> hidden states [T, hidden] in the model dtype."""
        return self.model(input_ids, positions)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [n, hidden] -> float32 logits [n, vocab]."""
        return self.lm_head(hidden)
