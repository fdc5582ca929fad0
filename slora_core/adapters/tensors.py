"""Reading the tensors of `adapter_model.safetensors` and checking each LoRA pair.

PEFT names a LoRA pair `base_model.model.<module>.lora_A.weight` / `.lora_B.weight`, where
<module> is the full module name (`model.layers.0.self_attn.q_proj`); an adapter-name segment
(`lora_A.default.weight`) is tolerated.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import safetensors.torch
import torch

from slora_core.adapters.errors import AdapterFormatError, AdapterIncompatibleError
from slora_core.adapters.targets import module_group
from slora_core.config import LORA_MODULES, ModelConfig

ACCEPTED_DTYPES = (torch.float32, torch.float16, torch.bfloat16)

_LORA_KEY = re.compile(
    r"^base_model\.model\.(?P<module>.+)\.lora_(?P<ab>[AB])(?:\.[^.]+)?\.(?P<param>weight|bias)$"
)
_LAYER_MODULE = re.compile(
    r"^(?P<prefix>(?:model\.)?)layers\.(?P<layer>\d+)\.(?P<group>[^.]+)\.(?P<module>[^.]+)$"
)


@dataclass
class LoraPair:
    """The A and B tensors found for one (layer, module), with their keys for messages."""

    module_path: str
    a_key: str = ""
    b_key: str = ""
    a: torch.Tensor | None = None
    b: torch.Tensor | None = None


@dataclass(frozen=True)
class LoraTensors:
    """All LoRA pairs of a file; `prefix` is what precedes `layers.` in module names."""

    prefix: str
    pairs: dict[tuple[int, str], LoraPair]


def load_safetensors(data: bytes, source: str) -> dict[str, torch.Tensor]:
    """Deserialize safetensors bytes; AdapterFormatError names `source` if they are corrupt."""
    try:
        return safetensors.torch.load(data)
    except Exception as e:  # safetensors raises its own error types and also ValueError/OSError
        raise AdapterFormatError(f"{source} is not a valid safetensors file: {e}") from None


def group_lora_tensors(
    tensors: dict[str, torch.Tensor], model: ModelConfig, source: str
) -> LoraTensors:
    """Sort every tensor into a (layer, module) LoRA pair.

    Raises AdapterIncompatibleError for tensors of unsupported features (DoRA magnitudes,
    embedding LoRA, LoRA biases, modules_to_save copies), for modules the base model lacks and
    layers out of range; AdapterFormatError for an empty file, duplicate or inconsistent keys.
    """
    if not tensors:
        raise AdapterFormatError(f"{source} holds no tensors")
    pairs: dict[tuple[int, str], LoraPair] = {}
    prefixes: set[str] = set()
    for key in sorted(tensors):
        layer, module, prefix, ab, path = _parse_key(key, model, source)
        prefixes.add(prefix)
        pair = pairs.setdefault((layer, module), LoraPair(path))
        if getattr(pair, ab) is not None:
            raise AdapterFormatError(
                f"{source}: tensors {getattr(pair, f'{ab}_key')!r} and {key!r} are both lora_"
                f"{ab.upper()} of {path} (several adapters in one file?)"
            )
        setattr(pair, ab, tensors[key])
        setattr(pair, f"{ab}_key", key)
    if len(prefixes) > 1:
        raise AdapterFormatError(f"{source}: tensor keys mix module prefixes {sorted(prefixes)}")
    return LoraTensors(prefixes.pop(), pairs)


def _parse_key(key: str, model: ModelConfig, source: str) -> tuple[int, str, str, str, str]:
    """(layer, module, prefix, 'a' or 'b', module path) of a LoRA tensor key."""
    where = f"{source}: tensor {key!r}"
    if "lora_magnitude_vector" in key:
        raise AdapterIncompatibleError(f"{where} is a DoRA magnitude vector; DoRA is not supported")
    if "lora_embedding_" in key:
        raise AdapterIncompatibleError(f"{where} is embedding LoRA, which is not supported")
    match = _LORA_KEY.match(key)
    if match is None:
        raise AdapterIncompatibleError(
            f"{where} is not a LoRA A/B weight (modules_to_save or trainable-token weights are "
            "not supported)"
        )
    if match["param"] == "bias":
        raise AdapterIncompatibleError(f"{where} is a LoRA bias (lora_bias), which is not supported")
    path = match["module"]
    module_match = _LAYER_MODULE.match(path)
    if module_match is None or not _is_lora_module(module_match["module"], module_match["group"]):
        what = ("the embedding or lm_head" if path.endswith(("embed_tokens", "lm_head"))
                else "a module LoRA can wrap in the base model")
        raise AdapterIncompatibleError(
            f"{where} targets {path!r}, which is not {what} (supported: {', '.join(LORA_MODULES)}"
            " in each decoder layer)"
        )
    layer = int(module_match["layer"])
    if layer >= model.num_hidden_layers:
        raise AdapterIncompatibleError(
            f"{where} is for layer {layer}, but the base model has {model.num_hidden_layers} layers"
        )
    return layer, module_match["module"], module_match["prefix"], match["ab"].lower(), path


def _is_lora_module(module: str, group: str) -> bool:
    return module in LORA_MODULES and group == module_group(module)


def check_pair_shapes(
    pair: LoraPair, module: str, model: ModelConfig, source: str
) -> tuple[torch.Tensor, torch.Tensor]:
    """The (A, B) of a pair after checking both exist, are 2-D floats of an accepted dtype,
    agree on their rank and fit the base module: A [r, in_features], B [out_features, r]."""
    if pair.a is None or pair.b is None:
        missing = "lora_A" if pair.a is None else "lora_B"
        raise AdapterFormatError(
            f"{source}: {pair.module_path} has no {missing} tensor "
            f"(found only {pair.a_key or pair.b_key!r})"
        )
    a, b = pair.a, pair.b
    for key, t in ((pair.a_key, a), (pair.b_key, b)):
        if t.dtype not in ACCEPTED_DTYPES:
            raise AdapterFormatError(
                f"{source}: tensor {key!r} has dtype {t.dtype}; expected float32, float16 or bfloat16"
            )
        if t.dim() != 2:
            raise AdapterFormatError(f"{source}: tensor {key!r} has shape {list(t.shape)}; expected 2-D")
    if a.shape[0] != b.shape[1]:
        raise AdapterFormatError(
            f"{source}: {pair.module_path}: lora_A {list(a.shape)} has rank {a.shape[0]} but "
            f"lora_B {list(b.shape)} has rank {b.shape[1]}"
        )
    in_features, out_features = model.module_shape(module)
    if a.shape[1] != in_features or b.shape[0] != out_features:
        raise AdapterIncompatibleError(
            f"{source}: {pair.module_path}: lora_A {list(a.shape)} / lora_B {list(b.shape)} do not "
            f"fit the base {module} (in_features={in_features}, out_features={out_features}); "
            "was the adapter trained on a different base model?"
        )
    return a, b


def to_dtype(t: torch.Tensor, dtype: torch.dtype, key: str, source: str) -> torch.Tensor:
    """`t` as a contiguous `dtype` tensor; AdapterFormatError if it holds NaN/inf before or
    after the cast (a float32 value beyond float16's range becomes inf)."""
    if not bool(torch.isfinite(t).all()):
        raise AdapterFormatError(f"{source}: tensor {key!r} contains non-finite values (NaN or inf)")
    out = t.to(dtype).contiguous()
    if not bool(torch.isfinite(out).all()):
        raise AdapterFormatError(
            f"{source}: tensor {key!r} overflows {dtype} (non-finite after the cast)"
        )
    return out

