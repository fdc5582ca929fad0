"""Shared pieces of the kernel tests: device and size choice, error norms, arena builders."""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch

from slora_kernels.lora_meta import LoraMeta

# Compiled kernels on a GPU when TRITON_INTERPRET=0 is set there; the interpreter on the CPU
# otherwise (conftest.py sets TRITON_INTERPRET=1 by default).
ON_GPU = os.environ.get("TRITON_INTERPRET") == "0" and torch.cuda.is_available()
DEVICE = torch.device("cuda" if ON_GPU else "cpu")
# The CPU interpreter computes bf16 wrongly, so bf16 runs only on the GPU.
DTYPES = [torch.float16, torch.bfloat16] if ON_GPU else [torch.float32, torch.float16]
# ||out - ref|| / ||ref|| against float64 references: float32 math lands far below 1e-4;
# 16-bit outputs carry their own rounding (fp16 2^-11, bf16 2^-8 relative per element).
TOLERANCE = {torch.float32: 1e-5, torch.float16: 4e-3, torch.bfloat16: 2e-2}


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    """||out - ref|| / ||ref|| in float64; NaN or inf anywhere gives inf."""
    out64, ref64 = out.double(), ref.double()
    if not torch.isfinite(out64).all():
        return float("inf")
    return float((out64 - ref64).norm() / ref64.norm().clamp_min(1e-30))


def generator(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def randn(*shape: int, dtype: torch.dtype, gen: torch.Generator, std: float = 1.0) -> torch.Tensor:
    """Normal samples drawn on the CPU (reproducible everywhere), moved to DEVICE."""
    return (torch.randn(*shape, generator=gen, dtype=torch.float64) * std).to(DEVICE, dtype)


@dataclass
class LoraCase:
    """One layer's offset tables over a NaN-poisoned arena, and a batch of segments."""

    arena: torch.Tensor
    a_offsets: torch.Tensor
    b_offsets: torch.Tensor
    ranks: torch.Tensor
    scales: torch.Tensor
    meta: LoraMeta


def build_lora_case(
    token_slots: list[int],
    num_slots: int,
    in_features: int,
    out_sizes: dict[int, int],
    rank_of: dict[tuple[int, int], int],
    dtype: torch.dtype,
    gen: torch.Generator,
    aligned: bool = False,
    block_m: int | None = None,
) -> LoraCase:
    """Place every (slot, module) A and B matrix at a shuffled, gapped position of an arena whose
    other elements are NaN, so any read outside a matrix poisons the output. `aligned` keeps
    every matrix start a multiple of 8 elements (as the page packer does for real models, and
    the kernels' vector-load path needs); otherwise odd gaps leave most starts unaligned."""
    num_modules = 7
    mats: list[tuple[int, int, str, int]] = []  # (slot, module, "a"/"b", numel)
    for (slot, mod), r in rank_of.items():
        if r > 0:
            mats += [(slot, mod, "a", r * in_features), (slot, mod, "b", out_sizes[mod] * r)]
    order = torch.randperm(len(mats), generator=gen).tolist()
    gap = 8 if aligned else 37
    total = sum(m[3] for m in mats) + gap * (len(mats) + 1)
    arena = torch.full((total,), float("nan"), dtype=dtype, device=DEVICE)
    a_off = torch.zeros(num_slots, num_modules, dtype=torch.int64)
    b_off = torch.zeros(num_slots, num_modules, dtype=torch.int64)
    ranks = torch.zeros(num_slots, num_modules, dtype=torch.int32)
    scales = torch.zeros(num_slots, num_modules, dtype=torch.float32)
    pos = gap
    for i in order:
        slot, mod, kind, numel = mats[i]
        r = rank_of[(slot, mod)]
        # A ~ N(0, 1/K) and B ~ N(0, 1/r) keep the delta of unit-variance inputs near unit scale.
        std = (1.0 / in_features) ** 0.5 if kind == "a" else (1.0 / r) ** 0.5
        arena[pos : pos + numel] = randn(numel, dtype=dtype, gen=gen, std=std)
        (a_off if kind == "a" else b_off)[slot, mod] = pos
        ranks[slot, mod] = r
        scales[slot, mod] = 0.5 + float(torch.rand(1, generator=gen))
        pos += numel + gap
    return LoraCase(
        arena=arena,
        a_offsets=a_off.to(DEVICE),
        b_offsets=b_off.to(DEVICE),
        ranks=ranks.to(DEVICE),
        scales=scales.to(DEVICE),
        meta=LoraMeta.from_token_slots(token_slots, device=DEVICE, block_m=block_m),
    )
