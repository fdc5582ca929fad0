"""Validating a downloaded adapter in bounded memory: the safetensors header first, then one
tensor at a time.

The engine's `load_adapter` reads both files whole and builds every tensor; a registration of a
multi-GB file would hold it all in the control plane's RAM. Here the file is never read whole:

1. `safetensors.safe_open` parses and checks the header (offsets inside the file, no overlaps);
   the shapes and dtypes it lists become meta tensors (no storage), so the engine's own checks
   (`group_lora_tensors`, `resolve_targets`, `check_pair_shapes`) run unchanged on them.
2. Each tensor's bytes are then read with a plain `seek`/`read` (not through the mmap, whose
   touched pages would stay in RSS until the file closes) and checked for NaN/inf, one at a
   time: memory is bounded by the largest single tensor, `max_rank * max_module_dim * 4` bytes.

`max_weights_bytes` is the size bound applied before downloading: what the base model's shapes
allow at `max_rank` in the widest accepted dtype, plus room for the header.
"""

from __future__ import annotations

import json
import struct
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from safetensors import safe_open

from slora_core.adapters import AdapterFormatError, AdapterIncompatibleError
from slora_core.adapters.files import CONFIG_FILE, WEIGHTS_FILE
from slora_core.adapters.peft_config import parse_peft_config
from slora_core.adapters.targets import resolve_targets
from slora_core.adapters.tensors import LoraPair, check_pair_shapes, group_lora_tensors
from slora_core.config import LORA_MODULES, ModelConfig

MAX_CONFIG_BYTES = 1 << 20
HEADER_BYTES_PER_TENSOR = 512  # a key of ~100 chars, dtype, shape and offsets, generously
HEADER_SLACK_BYTES = 1 << 20
# safetensors dtype names; others (ints, fp8) become uint8 meta tensors, which the shape check
# refuses with its usual "expected float32, float16 or bfloat16" message.
_DTYPES = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16}
_EXPONENT_BITS: dict[str, tuple[type[np.integer], int]] = {
    "F32": (np.uint32, 0x7F80_0000), "F16": (np.uint16, 0x7C00), "BF16": (np.uint16, 0x7F80)}


@dataclass(frozen=True)
class AdapterSummary:
    """What the registry records of a validated adapter (the fields of LoraAdapter it uses)."""

    rank: int
    lora_alpha: float
    use_rslora: bool
    target_modules: tuple[str, ...]
    num_bytes: int  # of all A and B tensors in float32, as the engine's loader counts them


def max_weights_bytes(model: ModelConfig, max_rank: int) -> int:
    """The largest adapter_model.safetensors a valid adapter can be: every module of every layer
    at `max_rank` in float32, plus header room."""
    per_layer = sum(max_rank * sum(model.module_shape(m)) for m in LORA_MODULES)
    tensors = 2 * len(LORA_MODULES) * model.num_hidden_layers
    return (per_layer * model.num_hidden_layers * 4 + tensors * HEADER_BYTES_PER_TENSOR
            + HEADER_SLACK_BYTES)


def validate_adapter_dir(path: Path, model: ModelConfig, max_rank: int,
                         source: str) -> AdapterSummary:
    """Validate a PEFT directory like `load_adapter` does, reading one tensor at a time.

    `source` (the storage URI) names the files in messages. Raises AdapterFormatError or
    AdapterIncompatibleError."""
    config_source, weights_source = f"{source}/{CONFIG_FILE}", f"{source}/{WEIGHTS_FILE}"
    cfg = parse_peft_config(_read_small(path / CONFIG_FILE, config_source), config_source)
    shapes = _header(path / WEIGHTS_FILE, weights_source)
    meta = {key: torch.empty(shape, dtype=dtype, device="meta")
            for key, (dtype, shape) in shapes.items()}
    tensors = group_lora_tensors(meta, model, weights_source)
    targets = resolve_targets(cfg, model, tensors.prefix, config_source)
    if tensors.pairs.keys() != targets.keys():
        extra = sorted(tensors.pairs.keys() ^ targets.keys())[0]
        raise AdapterFormatError(
            f"{config_source} and {weights_source} disagree on the targeted modules "
            f"(layer {extra[0]} {extra[1]} is in one but not the other)")
    ranks = [_checked_rank(pair, key[1], targets[key].rank, model, max_rank, weights_source)
             for key, pair in sorted(tensors.pairs.items())]
    _check_finite(path / WEIGHTS_FILE, weights_source)
    return AdapterSummary(
        rank=max(ranks), lora_alpha=cfg.lora_alpha, use_rslora=cfg.use_rslora,
        target_modules=tuple(m for m in LORA_MODULES if any(k[1] == m for k in tensors.pairs)),
        num_bytes=sum(t.numel() * 4 for t in meta.values()),
    )


def _checked_rank(pair: LoraPair, module: str, config_rank: int, model: ModelConfig,
                  max_rank: int, source: str) -> int:
    a, _b = check_pair_shapes(pair, module, model, source)
    rank = int(a.shape[0])
    if rank != config_rank:
        raise AdapterFormatError(f"{source}: {pair.module_path} has rank {rank} in its tensors, "
                                 f"but the config gives it rank {config_rank} (r / rank_pattern)")
    if rank > max_rank:
        raise AdapterIncompatibleError(
            f"{source}: {pair.module_path} has rank {rank}, above this engine's max_rank={max_rank}")
    return rank


def _read_small(path: Path, source: str) -> bytes:
    try:
        with path.open("rb") as f:
            data = f.read(MAX_CONFIG_BYTES + 1)
    except OSError as e:
        raise AdapterFormatError(f"cannot read {source}: {e.strerror or e}") from None
    if len(data) > MAX_CONFIG_BYTES:
        raise AdapterFormatError(f"{source} is over {MAX_CONFIG_BYTES} bytes")
    return data


def _header(path: Path, source: str) -> dict[str, tuple[torch.dtype, list[int]]]:
    """key -> (dtype, shape) from the header, after safetensors checked the file's layout."""
    try:
        with safe_open(str(path), framework="pt") as f:
            out = {}
            for key in f.keys():  # noqa: SIM118 (safe_open is not iterable)
                s = f.get_slice(key)
                out[key] = (_DTYPES.get(s.get_dtype(), torch.uint8), list(s.get_shape()))
    except Exception as e:  # safetensors raises its own error types for bad headers
        raise AdapterFormatError(f"{source} is not a valid safetensors file: {e}") from None
    if not out:
        raise AdapterFormatError(f"{source} holds no tensors")
    return out


def _check_finite(path: Path, source: str) -> None:
    with path.open("rb") as f:
        (header_len,) = struct.unpack("<Q", f.read(8))
        entries = json.loads(f.read(header_len))
        for key, entry in sorted(entries.items(), key=lambda kv: kv[0]):
            if key == "__metadata__":
                continue
            begin, end = entry["data_offsets"]
            f.seek(8 + header_len + begin)
            if not _all_finite(f.read(end - begin), entry["dtype"]):
                raise AdapterFormatError(
                    f"{source}: tensor {key!r} contains non-finite values (NaN or inf)")


def _all_finite(data: bytes, dtype: str) -> bool:
    """No NaN or inf among the IEEE floats in `data`: no value has an all-ones exponent. On the
    raw bits with numpy, which (unlike numpy's floats) covers bfloat16 too, and runs many times
    faster than torch.isfinite on a busy CPU."""
    int_type, exponent = _EXPONENT_BITS[dtype]
    bits = np.frombuffer(data, dtype=int_type)
    return not bool(np.any((bits & exponent) == exponent))
