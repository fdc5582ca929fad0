"""Rotary position embedding (RoPE) for Llama-family models, with the "linear" and Llama-3
("llama3") frequency scalings.

The inverse frequencies follow Hugging Face `modeling_rope_utils` exactly, so that positions
rotate bit-for-bit like the reference at float32. cos/sin are computed per step from the
positions (no table sized by max_position_embeddings), which keeps the op shape-static for
CUDA graphs and costs T x D/2 multiplies.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from slora_core.config import ConfigError, ModelConfig

SUPPORTED_ROPE_TYPES: tuple[str, ...] = ("default", "linear", "llama3")


@dataclass(frozen=True)
class RopeSettings:
    """The RoPE parameters of a model, normalised from either config style."""

    theta: float
    rope_type: str
    params: dict[str, Any]


def rope_settings(config: ModelConfig) -> RopeSettings:
    """Read RoPE settings from `rope_scaling` + `rope_theta` (transformers 4.x config.json) or
    from `rope_parameters` (transformers 5.x config.json, which moves `rope_theta` inside).

    Raises ConfigError for rope types this model does not implement (dynamic, yarn, longrope):
    serving them with plain RoPE would silently change the model's outputs.
    """
    params = dict(config.rope_scaling or config.raw.get("rope_parameters") or {})
    theta = float(params.pop("rope_theta", config.rope_theta))
    rope_type = str(params.pop("rope_type", params.pop("type", "default")))
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise ConfigError(f"unsupported rope_type {rope_type!r}; expected one of {SUPPORTED_ROPE_TYPES}")
    if rope_type == "llama3":
        params.setdefault("original_max_position_embeddings", config.max_position_embeddings)
        missing = {"factor", "low_freq_factor", "high_freq_factor"} - params.keys()
        if missing:
            raise ConfigError(f"llama3 rope_scaling lacks {sorted(missing)}")
    if rope_type == "linear" and "factor" not in params:
        raise ConfigError("linear rope_scaling lacks 'factor'")
    return RopeSettings(theta=theta, rope_type=rope_type, params=params)


def inverse_frequencies(settings: RopeSettings, head_dim: int, device: torch.device | str | None = None
                        ) -> torch.Tensor:
    """float32 [head_dim // 2] inverse frequencies, scaled as the rope type prescribes."""
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64).to(device=device, dtype=torch.float)
    inv_freq = 1.0 / (settings.theta ** (exponents / head_dim))
    p = settings.params
    if settings.rope_type == "linear":
        return inv_freq / float(p["factor"])
    if settings.rope_type == "llama3":
        return _llama3_scale(inv_freq, float(p["factor"]), float(p["low_freq_factor"]),
                             float(p["high_freq_factor"]), float(p["original_max_position_embeddings"]))
    return inv_freq


def _llama3_scale(inv_freq: torch.Tensor, factor: float, low_freq_factor: float,
                  high_freq_factor: float, old_context_len: float) -> torch.Tensor:
    # Long wavelengths (beyond the pre-training context) are slowed by `factor`, short ones kept,
    # and the band between is interpolated smoothly (Llama 3.1 release).
    low_freq_wavelen = old_context_len / low_freq_factor
    high_freq_wavelen = old_context_len / high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_context_len / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)


class RotaryEmbedding(nn.Module):
    """Per-token RoPE angles in the rotate-half convention of HF Llama, computed once per step
    and shared by every layer."""

    inv_freq: torch.Tensor

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.settings = rope_settings(config)
        self.head_dim = config.head_dim
        self.register_buffer("inv_freq", inverse_frequencies(self.settings, self.head_dim),
                             persistent=False)

    def reset_parameters(self) -> None:
        """Recompute `inv_freq` in float32 on its current device (after `to_empty` or a dtype
        cast of the whole model, which would otherwise leave it empty or rounded)."""
        self.inv_freq = inverse_frequencies(self.settings, self.head_dim, self.inv_freq.device)

    def forward(self, positions: torch.Tensor, dtype: torch.dtype
                ) -> tuple[torch.Tensor, torch.Tensor]:
        """positions [T] -> (cos, sin), each [T, 1, D] in `dtype`."""
        # float32 angles even for fp16/bf16 models: positions in the thousands lose whole
        # radians in half precision.
        freqs = positions.to(torch.float32)[:, None] * self.inv_freq.float()[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos().to(dtype)[:, None, :], emb.sin().to(dtype)[:, None, :]
