"""`load_adapter`: one validator for the engine and the control plane's registry."""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

import torch

from slora_core.adapters.errors import AdapterFormatError, AdapterIncompatibleError
from slora_core.adapters.files import (
    CONFIG_FILE,
    WEIGHTS_FILE,
    AdapterFiles,
    read_adapter_files,
)
from slora_core.adapters.peft_config import parse_peft_config
from slora_core.adapters.targets import TargetSpec, resolve_targets
from slora_core.adapters.tensors import (
    ACCEPTED_DTYPES,
    LoraPair,
    check_pair_shapes,
    group_lora_tensors,
    load_safetensors,
    to_dtype,
)
from slora_core.config import LORA_MODULES, ModelConfig


@dataclass(frozen=True, eq=False)
class LoraWeight:
    """One targeted module: delta W = scale * b @ a, so y += scale * (x @ a.T) @ b.T."""

    a: torch.Tensor  # [r, in_features], PEFT lora_A.weight, contiguous
    b: torch.Tensor  # [out_features, r], PEFT lora_B.weight, contiguous
    scale: float  # alpha/r, or alpha/sqrt(r) with use_rslora; rank/alpha patterns applied

    @property
    def rank(self) -> int:
        return self.a.shape[0]


@dataclass(frozen=True, eq=False)
class LoraAdapter:
    """A validated adapter: every targeted (layer, module) of the base model with its weight."""

    path: str
    sha256: str  # digest_adapter_dir of exactly the bytes that were parsed
    rank: int  # max rank over modules
    lora_alpha: float
    use_rslora: bool
    target_modules: tuple[str, ...]  # names from LORA_MODULES that carry a weight, in that order
    weights: dict[tuple[int, str], LoraWeight]  # (layer, module) -> weight; absent = not targeted
    base_model_name_or_path: str | None
    num_bytes: int  # bytes of all A and B tensors in the loaded dtype
    config: dict[str, Any]  # the parsed adapter_config.json


def load_adapter(
    path: str | os.PathLike[str],
    model_config: ModelConfig,
    *,
    max_rank: int,
    dtype: torch.dtype = torch.float32,
    expected_sha256: str | None = None,
) -> LoraAdapter:
    """Read, hash, parse and validate a PEFT LoRA directory against a base model.

    Each file is read once; the digest (see `digest_adapter_dir`) covers exactly the bytes the
    weights and config are parsed from. Targets, ranks and scales follow peft 0.21's rules
    (target_modules list/regex/"all-linear", exclude_modules, layers_to_transform,
    layers_pattern, rank_pattern, alpha_pattern, use_rslora); every targeted module must have
    a lora_A [r, in] and lora_B [out, r] of the rank the config gives it and no other tensors
    may be present. Weights are returned as contiguous `dtype` tensors.

    Raises AdapterFormatError (bad files, malformed config, non-finite values, dtype other than
    fp32/fp16/bf16, sha256 different from `expected_sha256`) or AdapterIncompatibleError (does
    not fit `model_config`, rank above `max_rank`, unsupported PEFT feature).
    """
    return parse_adapter(read_adapter_files(path), model_config, max_rank=max_rank, dtype=dtype,
                         expected_sha256=expected_sha256)


def parse_adapter(
    files: AdapterFiles,
    model_config: ModelConfig,
    *,
    max_rank: int,
    dtype: torch.dtype = torch.float32,
    expected_sha256: str | None = None,
) -> LoraAdapter:
    """`load_adapter` on files already read (from disk, or serialized from tensors in memory:
    `adapter_files_from_tensors`)."""
    if dtype not in ACCEPTED_DTYPES:
        raise ValueError(f"dtype must be one of {ACCEPTED_DTYPES}, got {dtype}")
    sha256 = files.sha256
    if expected_sha256 is not None and sha256 != expected_sha256.strip().lower():
        raise AdapterFormatError(
            f"{files.path}: sha256 mismatch: the files digest to {sha256}, "
            f"expected {expected_sha256}"
        )
    config_source, weights_source = str(files.path / CONFIG_FILE), str(files.path / WEIGHTS_FILE)
    cfg = parse_peft_config(files.config_bytes, config_source)
    tensors = group_lora_tensors(
        load_safetensors(files.weights_bytes, weights_source), model_config, weights_source
    )
    targets = resolve_targets(cfg, model_config, tensors.prefix, config_source)
    _check_same_modules(targets, tensors.pairs, config_source, weights_source)
    weights = {
        key: _build_weight(pair, targets[key], key[1], model_config, max_rank, dtype, weights_source)
        for key, pair in sorted(tensors.pairs.items())
    }
    return LoraAdapter(
        path=str(files.path),
        sha256=sha256,
        rank=max(w.rank for w in weights.values()),
        lora_alpha=cfg.lora_alpha,
        use_rslora=cfg.use_rslora,
        target_modules=tuple(m for m in LORA_MODULES if any(k[1] == m for k in weights)),
        weights=weights,
        base_model_name_or_path=cfg.base_model_name_or_path,
        num_bytes=sum((w.a.numel() + w.b.numel()) * w.a.element_size() for w in weights.values()),
        config=cfg.raw,
    )


def _check_same_modules(
    targets: dict[tuple[int, str], TargetSpec],
    pairs: dict[tuple[int, str], LoraPair],
    config_source: str,
    weights_source: str,
) -> None:
    """The config and the tensors must agree on the targeted modules: a tensor PEFT would not
    load, or a targeted module PEFT would leave at its initial value, means a broken adapter."""
    for key in sorted(pairs.keys() - targets.keys()):
        pair = pairs[key]
        raise AdapterFormatError(
            f"{weights_source}: tensor {pair.a_key or pair.b_key!r} is for {pair.module_path}, "
            f"which {config_source} does not target"
        )
    for key in sorted(targets.keys() - pairs.keys()):
        raise AdapterFormatError(
            f"{config_source} targets {targets[key].name}, but {weights_source} has no "
            "lora_A/lora_B tensors for it"
        )


def _build_weight(
    pair: LoraPair,
    spec: TargetSpec,
    module: str,
    model: ModelConfig,
    max_rank: int,
    dtype: torch.dtype,
    source: str,
) -> LoraWeight:
    a, b = check_pair_shapes(pair, module, model, source)
    rank = a.shape[0]
    if rank != spec.rank:
        raise AdapterFormatError(
            f"{source}: {spec.name} has rank {rank} in its tensors, but the config gives it "
            f"rank {spec.rank} (r / rank_pattern)"
        )
    if rank > max_rank:
        raise AdapterIncompatibleError(
            f"{source}: {spec.name} has rank {rank}, above this engine's max_rank={max_rank}"
        )
    return LoraWeight(
        a=to_dtype(a, dtype, pair.a_key, source),
        b=to_dtype(b, dtype, pair.b_key, source),
        scale=spec.scale,
    )
