"""Build a `LlamaForCausalLM` from a Hugging Face checkpoint directory, or with seeded random
weights at any shape (benchmarks without a download).

Loading streams one tensor at a time from each safetensors file into the parameters (already
allocated on the target device in the target dtype), fusing q/k/v and gate/up as it goes, so a
checkpoint is never held twice in memory.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open

from slora_core.config import ConfigError, ModelConfig
from slora_core.model import LlamaForCausalLM

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
# Old checkpoints store RoPE frequencies; we recompute them from the config.
_IGNORED = re.compile(r"model\.layers\.\d+\.self_attn\.rotary_emb\.inv_freq")


@dataclass(frozen=True)
class _Target:
    """Where one checkpoint tensor goes: rows [row_start, row_start + rows) of `param`."""

    param: str
    row_start: int
    rows: int


def _checkpoint_targets(config: ModelConfig) -> dict[str, _Target]:
    """Every tensor name a HF checkpoint of `config` must hold, mapped onto our parameters."""
    q = config.num_attention_heads * config.head_dim
    kv = config.num_key_value_heads * config.head_dim
    inter, hidden = config.intermediate_size, config.hidden_size
    targets = {
        "model.embed_tokens.weight": _Target("model.embed_tokens.weight", 0, config.vocab_size),
        "model.norm.weight": _Target("model.norm.weight", 0, hidden),
    }
    if not config.tie_word_embeddings:
        targets["lm_head.weight"] = _Target("lm_head.weight", 0, config.vocab_size)
    fused = {"q_proj": (0, q), "k_proj": (q, kv), "v_proj": (q + kv, kv)}
    for i in range(config.num_hidden_layers):
        p = f"model.layers.{i}."
        for name, (start, rows) in fused.items():
            targets[f"{p}self_attn.{name}.weight"] = _Target(f"{p}self_attn.qkv_proj.weight", start, rows)
            if config.attention_bias:
                targets[f"{p}self_attn.{name}.bias"] = _Target(f"{p}self_attn.qkv_proj.bias", start, rows)
        targets[f"{p}mlp.gate_proj.weight"] = _Target(f"{p}mlp.gate_up_proj.weight", 0, inter)
        targets[f"{p}mlp.up_proj.weight"] = _Target(f"{p}mlp.gate_up_proj.weight", inter, inter)
        for name, rows in (("self_attn.o_proj", hidden), ("mlp.down_proj", hidden),
                           ("input_layernorm", hidden), ("post_attention_layernorm", hidden)):
            targets[f"{p}{name}.weight"] = _Target(f"{p}{name}.weight", 0, rows)
        if config.o_proj_bias:
            targets[f"{p}self_attn.o_proj.bias"] = _Target(f"{p}self_attn.o_proj.bias", 0, hidden)
    return targets


def checkpoint_shapes(config: ModelConfig) -> dict[str, tuple[int, ...]]:
    """The name and shape of every tensor in a HF checkpoint of `config` (lm_head omitted when
    embeddings are tied), in a stable order."""
    model = empty_model(config, torch.float32, "meta")
    params = dict(model.named_parameters(remove_duplicate=False))
    return {name: (t.rows, *params[t.param].shape[1:])
            for name, t in _checkpoint_targets(config).items()}


def empty_model(config: ModelConfig, dtype: torch.dtype, device: torch.device | str
                ) -> LlamaForCausalLM:
    """A model with uninitialised parameters on `device` in `dtype` (RoPE buffers valid, in
    float32). Building on the meta device first skips the default init, which is slow at 7B+."""
    with torch.device("meta"):
        model = LlamaForCausalLM(config)
    model = model.to(dtype=dtype).to_empty(device=device)
    model.tie_weights()
    model.reset_buffers()
    return model.eval().requires_grad_(False)


def build_random_model(config: ModelConfig, dtype: torch.dtype, device: torch.device | str,
                       seed: int = 0, std: float = 0.02) -> LlamaForCausalLM:
    """A model with seeded N(0, std) weights generated on `device` (norm weights 1, biases 0).
    The same (config, seed, device type) gives the same weights."""
    model = empty_model(config, dtype, device)
    gen = torch.Generator(device=torch.device(device)).manual_seed(seed)
    for name, param in model.named_parameters():
        if name.endswith("norm.weight"):
            param.fill_(1.0)
        elif name.endswith(".bias"):
            param.zero_()
        else:
            param.normal_(0.0, std, generator=gen)
    return model


def checkpoint_files(path: Path) -> list[Path]:
    """The safetensors files of a HF model directory: those named by the shard index if there
    is one, else `model.safetensors`, else every `*.safetensors` (sorted)."""
    index = path / INDEX_FILE
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError, TypeError) as e:
            raise ConfigError(f"{index} is not a valid safetensors index: {e}") from None
        files = [path / name for name in sorted(set(weight_map.values()))]
    elif (path / SINGLE_FILE).is_file():
        files = [path / SINGLE_FILE]
    else:
        files = sorted(path.glob("*.safetensors"))
    if not files:
        raise ConfigError(f"no safetensors weights in {path}")
    for f in files:
        if not f.is_file():
            raise ConfigError(f"{f} is listed in {index} but does not exist")
    return files


def load_model(path: str | Path, dtype: torch.dtype, device: torch.device | str
               ) -> LlamaForCausalLM:
    """Load a HF Llama-family directory (config.json + safetensors) into our model.

    Raises ConfigError naming the file and tensor for an unexpected tensor, a tensor of the
    wrong shape or non-float dtype, a tensor found twice, or (naming the directory) any
    expected tensor the checkpoint lacks.
    """
    path = Path(path)
    config = ModelConfig.from_hf_dir(path)
    model = empty_model(config, dtype, device)
    params = dict(model.named_parameters(remove_duplicate=False))
    targets = _checkpoint_targets(config)
    seen: dict[str, Path] = {}
    for file in checkpoint_files(path):
        with safe_open(str(file), framework="pt", device="cpu") as f:
            for name in f.keys():  # noqa: SIM118 (safe_open is not a Mapping)
                if _skip(name, config):
                    continue
                if name in seen:
                    raise ConfigError(f"tensor {name!r} appears in both {seen[name]} and {file}")
                seen[name] = file
                _copy_tensor(f.get_tensor(name), name, file, targets, params)
    missing = [n for n in targets if n not in seen]
    if missing:
        more = f" and {len(missing) - 5} more" if len(missing) > 5 else ""
        raise ConfigError(f"checkpoint {path} lacks tensors {missing[:5]}{more}")
    return model


def _skip(name: str, config: ModelConfig) -> bool:
    # A tied checkpoint may still carry lm_head; HF ties it to the embedding regardless.
    return bool(_IGNORED.fullmatch(name)) or (config.tie_word_embeddings and name == "lm_head.weight")


def _copy_tensor(tensor: torch.Tensor, name: str, file: Path, targets: dict[str, _Target],
                 params: dict[str, torch.nn.Parameter]) -> None:
    target = targets.get(name)
    if target is None:
        raise ConfigError(f"unexpected tensor {name!r} in {file} (not part of this model config)")
    param = params[target.param]
    expected = (target.rows, *param.shape[1:])
    if tuple(tensor.shape) != expected:
        raise ConfigError(f"tensor {name!r} in {file} has shape {tuple(tensor.shape)}, "
                          f"expected {expected}")
    if not tensor.is_floating_point():
        raise ConfigError(f"tensor {name!r} in {file} has dtype {tensor.dtype}, expected a float")
    param.data[target.row_start:target.row_start + target.rows].copy_(tensor)
