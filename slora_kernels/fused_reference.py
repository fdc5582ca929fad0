"""Torch references of the small fused ops (RMSNorm with residual add, rotary embedding,
SiLU-and-multiply). Their roundings follow Hugging Face Llama in the model dtype, so the Triton
versions match HF outputs as closely as the unfused torch code does."""

from __future__ import annotations

import torch


def rms_norm_reference(x: torch.Tensor, weight: torch.Tensor, eps: float,
                       residual: torch.Tensor | None = None
                       ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """With residual: residual += x (in place, model dtype), y = norm(residual).
    Without: y = norm(x). norm(h) = weight * (h / sqrt(mean(h^2) + eps)).to(dtype), in float32.
    Returns (y, residual)."""
    if residual is not None:
        residual.add_(x)
        x = residual
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(x.dtype), residual


def rotary_reference(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
                     ) -> None:
    """Rotate q [T, H, D] and k [T, Hkv, D] in place (rotate-half convention) by cos/sin
    [T, D] (each half repeated, as HF builds them)."""
    half = q.shape[-1] // 2
    c, s = cos[:, None, :], sin[:, None, :]
    for t in (q, k):
        rot = torch.cat((-t[..., half:], t[..., :half]), dim=-1)
        t.copy_(t * c + rot * s)


def silu_mul_reference(gate_up: torch.Tensor) -> torch.Tensor:
    """[T, 2I] (gate columns, then up columns) -> silu(gate) * up, [T, I]."""
    gate, up = gate_up.chunk(2, dim=-1)
    return torch.nn.functional.silu(gate) * up
