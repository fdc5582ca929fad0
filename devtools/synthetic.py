"""Seeded random LoRA adapters of given ranks, built in memory (benchmarks without files)."""

from __future__ import annotations

import dataclasses

import torch

from slora_core.adapters import LoraAdapter, LoraWeight
from slora_core.config import LORA_MODULES, ModelConfig


def random_adapter(
    config: ModelConfig,
    rank: int,
    *,
    modules: tuple[str, ...] = ("q_proj", "k_proj", "v_proj", "o_proj"),
    alpha: float | None = None,
    dtype: torch.dtype = torch.float16,
    seed: int = 0,
    std: float = 0.02,
    pin_memory: bool = False,
) -> LoraAdapter:
    """An adapter with N(0, std) A and B on every layer's `modules` (scale alpha/r, alpha
    defaults to 2r). Tensors are on the CPU: the engine copies them into arena pages."""
    unknown = set(modules) - set(LORA_MODULES)
    if unknown:
        raise ValueError(f"unknown modules {sorted(unknown)}")
    if rank <= 0:
        raise ValueError(f"rank must be positive, got {rank}")
    gen = torch.Generator().manual_seed(seed)
    alpha = float(2 * rank if alpha is None else alpha)
    weights = {}
    for layer in range(config.num_hidden_layers):
        for module in modules:
            fan_in, fan_out = config.module_shape(module)
            a = (torch.randn(rank, fan_in, generator=gen) * std).to(dtype)
            b = (torch.randn(fan_out, rank, generator=gen) * std).to(dtype)
            if pin_memory:
                a, b = a.pin_memory(), b.pin_memory()
            weights[(layer, module)] = LoraWeight(a=a, b=b, scale=alpha / rank)
    return _random_adapter_of(weights, rank, alpha, modules, seed)


def shared_weight_view(adapter: LoraAdapter, seed: int) -> LoraAdapter:
    """A distinct adapter identity over the same host tensors (for thousands of adapters whose
    host copies would not fit in memory; the engine still gives each its own arena pages)."""
    return dataclasses.replace(adapter, path=f"{adapter.path}/view{seed}",
                               sha256=f"{adapter.sha256}-view{seed}")


class SeededWeights(dict):  # type: ignore[type-arg]
    """The weights of a `seeded_adapter`: pickled as their recipe and rebuilt (once per
    process) when unpickled, so another process (a tensor-parallel rank) receives an adapter of
    any size in a few hundred bytes and makes the same tensors itself."""

    def __init__(self, recipe: tuple[object, ...],
                 weights: dict[tuple[int, str], LoraWeight]) -> None:
        super().__init__(weights)
        self.recipe = recipe

    def __reduce__(self) -> tuple[object, tuple[object, ...]]:  # type: ignore[override]
        return (_seeded_weights, self.recipe)


_SEEDED: dict[str, SeededWeights] = {}


def _seeded_weights(config: ModelConfig, rank: int, modules: tuple[str, ...], alpha: float,
                    dtype: torch.dtype, seed: int, std: float) -> SeededWeights:
    recipe = (config, rank, modules, alpha, dtype, seed, std)
    key = repr(recipe)
    if key not in _SEEDED:
        adapter = random_adapter(config, rank, modules=modules, alpha=alpha, dtype=dtype,
                                 seed=seed, std=std)
        _SEEDED[key] = SeededWeights(recipe, adapter.weights)
    return _SEEDED[key]


def seeded_adapter(config: ModelConfig, rank: int, *,
                   modules: tuple[str, ...] = ("q_proj", "k_proj", "v_proj", "o_proj"),
                   alpha: float | None = None, dtype: torch.dtype = torch.float16,
                   seed: int = 0, std: float = 0.02) -> LoraAdapter:
    """`random_adapter`'s adapter, whose weights pickle as their recipe (`SeededWeights`);
    one process builds each (config, rank, modules, alpha, dtype, seed, std) once."""
    alpha = float(2 * rank if alpha is None else alpha)
    weights = _seeded_weights(config, rank, tuple(modules), alpha, dtype, seed, std)
    return _random_adapter_of(weights, rank, alpha, modules, seed)


def _random_adapter_of(weights: dict[tuple[int, str], LoraWeight], rank: int, alpha: float,
                       modules: tuple[str, ...], seed: int) -> LoraAdapter:
    nbytes = sum(w.a.nbytes + w.b.nbytes for w in weights.values())
    return LoraAdapter(
        path=f"random://rank{rank}/seed{seed}", sha256=f"random-{rank}-{seed}",
        rank=rank, lora_alpha=alpha, use_rslora=False,
        target_modules=tuple(m for m in LORA_MODULES if m in modules), weights=weights,
        base_model_name_or_path=None, num_bytes=nbytes, config={"r": rank, "lora_alpha": alpha},
    )
