"""Which (layer, module) pairs an adapter config targets on a given base model, and their scales.

Module names are those of a Hugging Face Llama-family model as PEFT sees them
(`named_modules()` of the model PEFT wrapped): `model.layers.3.self_attn.q_proj` when PEFT
wrapped a `*ForCausalLM` (prefix "model."), `layers.3.self_attn.q_proj` for a bare `*Model`.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

from slora_core.adapters.errors import AdapterIncompatibleError
from slora_core.adapters.peft_config import PeftLoraConfig
from slora_core.config import LORA_MODULES, ModelConfig

ATTENTION_MODULES = frozenset({"q_proj", "k_proj", "v_proj", "o_proj"})
CAUSAL_LM_PREFIX = "model."


def module_group(module: str) -> str:
    """The submodule of a decoder layer that owns a LoRA-able projection."""
    return "self_attn" if module in ATTENTION_MODULES else "mlp"


def module_name(prefix: str, layer: int, module: str) -> str:
    """Full module name, e.g. `model.layers.0.mlp.up_proj`."""
    return f"{prefix}layers.{layer}.{module_group(module)}.{module}"


@dataclass(frozen=True)
class TargetSpec:
    """What the config promises for one targeted module."""

    name: str
    rank: int
    alpha: float
    scale: float


def resolve_targets(
    cfg: PeftLoraConfig, model: ModelConfig, prefix: str, source: str
) -> dict[tuple[int, str], TargetSpec]:
    """Targeted (layer, module) pairs with their config rank and scale, following PEFT's rules.

    Raises AdapterIncompatibleError when the config targets something this engine cannot wrap
    (embeddings, lm_head, non-linear modules), names a module or layer the base model lacks, or
    targets nothing at all.
    """
    _check_layers_in_range(cfg, model, source)
    for name, reason in _other_modules(model, prefix):
        if cfg.is_targeted(name):
            raise AdapterIncompatibleError(
                f"{source}: target_modules matches {name!r}, {reason}"
            )
    _check_targets_exist(cfg, model, prefix, source)
    targets: dict[tuple[int, str], TargetSpec] = {}
    for layer in range(model.num_hidden_layers):
        for module in LORA_MODULES:
            name = module_name(prefix, layer, module)
            if cfg.is_targeted(name):
                r, alpha = cfg.rank_and_alpha(name)
                targets[(layer, module)] = TargetSpec(name, r, alpha, cfg.scale(r, alpha))
    if not targets:
        raise AdapterIncompatibleError(
            f"{source}: target_modules={cfg.target_modules!r} (with exclude_modules and "
            "layers_to_transform) selects no module of the base model"
        )
    return targets


def _check_layers_in_range(cfg: PeftLoraConfig, model: ModelConfig, source: str) -> None:
    for index in cfg.layers_to_transform or ():
        if not 0 <= index < model.num_hidden_layers:
            raise AdapterIncompatibleError(
                f"{source}: layers_to_transform names layer {index}, but the base model has "
                f"{model.num_hidden_layers} layers"
            )


def _check_targets_exist(cfg: PeftLoraConfig, model: ModelConfig, prefix: str, source: str) -> None:
    if isinstance(cfg.target_modules, str):
        return  # a regex that matches nothing is reported as "selects no module"
    names = [module_name(prefix, layer, m)
             for layer in range(model.num_hidden_layers) for m in LORA_MODULES]
    others = list(_other_modules(model, prefix))
    for target in cfg.target_modules:
        if any(_matches(n, target) for n in names):
            continue
        for name, reason in others:
            if _matches(name, target):
                raise AdapterIncompatibleError(
                    f"{source}: target module {target!r} matches {name!r}, {reason}"
                )
        raise AdapterIncompatibleError(
            f"{source}: target module {target!r} does not exist in the base model "
            f"({model.model_type}); LoRA can target {', '.join(LORA_MODULES)}"
        )


def _matches(name: str, target: str) -> bool:
    return name == target or name.endswith(f".{target}")


def _other_modules(model: ModelConfig, prefix: str) -> Iterator[tuple[str, str]]:
    """Every other module a Llama-family model has, with why LoRA cannot go there."""
    embed = "LoRA on the embedding or lm_head is not supported"
    not_linear = "which is not one of the linear layers LoRA can wrap here"
    yield f"{prefix}embed_tokens", embed
    if prefix == CAUSAL_LM_PREFIX:
        yield "lm_head", embed
        yield "model", not_linear
    for name in ("layers", "norm", "rotary_emb"):
        yield f"{prefix}{name}", not_linear
    for layer in range(model.num_hidden_layers):
        base = f"{prefix}layers.{layer}"
        for name in ("", ".self_attn", ".mlp", ".mlp.act_fn", ".input_layernorm",
                     ".post_attention_layernorm"):
            yield base + name, not_linear
