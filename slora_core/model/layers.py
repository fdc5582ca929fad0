"""The building blocks of a Llama-family decoder layer over a flattened batch of T tokens.

Attention reads the step's paged-KV metadata from `slora_core.context.get_context()` and calls
the device-dispatched ops in `slora_core.ops`; nothing here knows about sequences, pages or LoRA
(the LoRA wrapper replaces `qkv_proj`, `o_proj`, `gate_up_proj` and `down_proj` by name).
"""

from __future__ import annotations

import torch
from torch import nn

from slora_core import ops
from slora_core.config import ModelConfig
from slora_core.context import get_context


class RMSNorm(nn.Module):
    """y = weight * x / sqrt(mean(x^2) + eps), normalised in float32 (as HF Llama does).
    Given `residual`, first adds x into it in place and normalises the sum (one fused op)."""

    def __init__(self, hidden_size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None
                ) -> tuple[torch.Tensor, torch.Tensor | None]:
        return ops.rms_norm(x, self.weight, self.eps, residual)


class Attention(nn.Module):
    """GQA self-attention over the paged KV cache of layer `layer_idx`.

    qkv_proj rows are q (H*D) then k (Hkv*D) then v (Hkv*D), the order the loader fuses them in.
    """

    def __init__(self, config: ModelConfig, layer_idx: int) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = config.head_dim
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        self.scale = self.head_dim**-0.5
        self.qkv_proj = nn.Linear(config.hidden_size, self.q_size + 2 * self.kv_size,
                                  bias=config.attention_bias)
        self.o_proj = nn.Linear(self.q_size, config.hidden_size, bias=config.o_proj_bias)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """x [T, hidden], RoPE angles cos/sin [T, D] -> [T, hidden]."""
        ctx = get_context()
        num_tokens = x.shape[0]
        qkv = self.qkv_proj(x)
        kv_end = self.q_size + self.kv_size
        # Plain slices (not split()): rotary rotates q and k in place inside qkv.
        q = qkv[:, : self.q_size].view(num_tokens, self.num_heads, self.head_dim)
        k = qkv[:, self.q_size : kv_end].view(num_tokens, self.num_kv_heads, self.head_dim)
        v = qkv[:, kv_end:].view(num_tokens, self.num_kv_heads, self.head_dim)
        ops.rotary(q, k, cos, sin)
        k_cache, v_cache = ctx.kv_caches[self.layer_idx]
        ops.write_kv(k_cache, v_cache, k, v, ctx.slot_mapping)
        out = ops.paged_attention(q, k_cache, v_cache, ctx.block_tables, ctx.seq_lens,
                                  ctx.query_starts, self.scale, max_query_len=ctx.max_query_len)
        return self.o_proj(out.reshape(num_tokens, self.q_size))


class MLP(nn.Module):
    """SwiGLU: down(silu(gate(x)) * up(x)), with gate rows then up rows fused in gate_up_proj."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.intermediate_size = config.intermediate_size
        self.gate_up_proj = nn.Linear(config.hidden_size, 2 * config.intermediate_size, bias=False)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(ops.silu_mul(self.gate_up_proj(x)))


class DecoderLayer(nn.Module):
    """Pre-norm residual block: x + attn(norm(x)), then x + mlp(norm(x))."""

    def __init__(self, config: ModelConfig, layer_idx: int) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = Attention(config, layer_idx)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = MLP(config)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None, cos: torch.Tensor,
                sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """vLLM-style residual stream: returns (this layer's mlp output, the residual sum so
        far); the next norm adds them, so each add fuses into a norm."""
        if residual is None:
            residual = x
            h, _ = self.input_layernorm(x)
        else:
            h, residual = self.input_layernorm(x, residual)
        h, residual = self.post_attention_layernorm(self.self_attn(h, cos, sin), residual)
        assert residual is not None
        return self.mlp(h), residual
