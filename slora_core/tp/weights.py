"""Load one rank's shard of a HF Llama-family checkpoint: each tensor is read through
`safe_open(...).get_slice`, so only this rank's rows or columns ever leave the file. Or build
it from seeded random weights (`RandomWeights`), on the device, with no checkpoint at all."""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

from slora_core.config import ConfigError, ModelConfig
from slora_core.model import LlamaForCausalLM
from slora_core.tp.group import TPGroup
from slora_core.tp.layers import parallelize_vocab
from slora_core.tp.shard import ROW_PARALLEL, TPShard
from slora_core.weights import (
    _checkpoint_targets,
    _copy_tensor,
    _skip,
    checkpoint_files,
    checkpoint_shapes,
    empty_model,
)

_LAYER_TENSOR = re.compile(r"model\.layers\.\d+\.(?:self_attn|mlp)\.(\w+)\.(weight|bias)")
_VOCAB = ("model.embed_tokens.weight", "lm_head.weight")


def load_model_shard(path: str | Path, shard: TPShard, dtype: torch.dtype,
                     device: torch.device | str, group: TPGroup) -> LlamaForCausalLM:
    """This rank's model: local heads, MLP width and vocabulary slice, with vocab-parallel
    embedding and LM head (the row-parallel sums are added after the LoRA wrap, see
    `parallelize_rows`). Raises ConfigError as `slora_core.weights.load_model` does."""
    path = Path(path)
    local = shard.model_config()
    model = empty_model(local, dtype, device)
    params = dict(model.named_parameters(remove_duplicate=False))
    targets = _checkpoint_targets(local)
    seen: dict[str, Path] = {}
    for file in checkpoint_files(path):
        with safe_open(str(file), framework="pt", device="cpu") as f:
            for name in f.keys():  # noqa: SIM118 (safe_open is not a Mapping)
                if _skip(name, shard.full):
                    continue
                if name in seen:
                    raise ConfigError(f"tensor {name!r} appears in both {seen[name]} and {file}")
                seen[name] = file
                _copy_tensor(_read_shard(f.get_slice(name), name, shard), name, file, targets,
                             params)
    missing = [n for n in targets if n not in seen]
    if missing:
        raise ConfigError(f"checkpoint {path} lacks tensors {missing[:5]}")
    parallelize_vocab(model, shard.vocab_start, group)
    return model


def _read_shard(tensor: Any, name: str, shard: TPShard) -> torch.Tensor:
    """The part of checkpoint tensor `name` (a safetensors slice) that this rank holds."""
    if name in _VOCAB:
        return tensor[shard.vocab_start:shard.vocab_start + shard.local_vocab]
    m = _LAYER_TENSOR.fullmatch(name)
    if m is None:
        return tensor[:]  # norms: replicated
    module, kind = m.groups()
    start, stop = shard.module_range(module)
    if module not in ROW_PARALLEL:
        return tensor[start:stop]
    if kind == "weight":
        return tensor[:, start:stop]
    # A row-parallel bias is added once: on rank 0; the all-reduce brings it to every rank.
    full = tensor[:]
    return full if shard.rank == 0 else torch.zeros_like(full)


@dataclass(frozen=True)
class RandomWeights:
    """A model with seeded random weights instead of a checkpoint (benchmarks at shapes no disk
    holds): linear and embedding weights N(0, std), norm weights 1. Each tensor is generated
    whole on the device from its own seed and cut to the rank's part, so every tensor parallel
    size gives slices of the same model (and `random_checkpoint_tensor` the full tensors, for a
    reference)."""

    config: ModelConfig
    seed: int = 0
    std: float = 0.02


def random_checkpoint_tensor(weights: RandomWeights, index: int, name: str,
                             shape: tuple[int, ...], dtype: torch.dtype,
                             device: torch.device | str) -> torch.Tensor:
    """Checkpoint tensor `name` (number `index` in `checkpoint_shapes` order) of `weights`."""
    if name.endswith("norm.weight"):
        return torch.ones(shape, dtype=dtype, device=device)
    gen = torch.Generator(device=torch.device(device)).manual_seed(weights.seed * 100_003 + index)
    out = torch.empty(shape, dtype=dtype, device=device)
    return out.normal_(0.0, weights.std, generator=gen)


def random_model_shard(weights: RandomWeights, shard: TPShard, dtype: torch.dtype,
                       device: torch.device | str, group: TPGroup) -> LlamaForCausalLM:
    """This rank's model (as `load_model_shard` gives it) with `weights`' random values, made
    on `device`: only one full tensor at a time exists there (the largest: the embedding)."""
    if weights.config != shard.full:
        raise ConfigError("the shard and the random weights describe different models")
    model = empty_model(shard.model_config(), dtype, device)
    params = dict(model.named_parameters(remove_duplicate=False))
    targets = _checkpoint_targets(shard.model_config())
    source = Path(f"random-seed{weights.seed}")
    for index, (name, shape) in enumerate(checkpoint_shapes(shard.full).items()):
        full = random_checkpoint_tensor(weights, index, name, shape, dtype, device)
        _copy_tensor(_read_shard(full, name, shard), name, source, targets, params)
        del full
    if shard.size > 1:
        parallelize_vocab(model, shard.vocab_start, group)
    return model
