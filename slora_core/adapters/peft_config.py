"""Parsing `adapter_config.json` the way peft 0.21 reads it, and PEFT's module-matching rules.

The matching functions are ports of peft's `check_target_module_exists` (target_modules,
exclude_modules, layers_to_transform, layers_pattern) and `get_pattern_key`
(rank_pattern / alpha_pattern): an adapter must get exactly the modules and scales PEFT gives it.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from typing import Any

from slora_core.adapters.errors import AdapterFormatError, AdapterIncompatibleError
from slora_core.config import LORA_MODULES

# peft's TRANSFORMERS_MODELS_TO_LORA_TARGET_MODULES_MAPPING for the model types we serve, used
# when a config leaves target_modules out.
_DEFAULT_TARGETS: tuple[str, ...] = ("q_proj", "v_proj")
_ALL_LINEAR = "all-linear"

# Config fields naming PEFT features whose forward pass or weights differ from plain LoRA
# (B @ A * scale added to a base linear). Any truthy value is refused.
_UNSUPPORTED_FIELDS: dict[str, str] = {
    "use_dora": "DoRA",
    "modules_to_save": "fully trained copies of base modules",
    "lora_bias": "a bias on lora_B",
    "trainable_token_indices": "trainable token embeddings",
    "target_parameters": "LoRA on raw parameters",
    "layer_replication": "layer replication",
    "alora_invocation_tokens": "activated LoRA (aLoRA)",
    "use_qalora": "QALoRA",
    "velora_config": "VeLoRA",
    "monteclora_config": "MonteCLoRA",
    "use_bdlora": "block-diagonal LoRA",
    "arrow_config": "Arrow routing",
    "kasa_config": "KaSA",
}


@dataclass(frozen=True)
class PeftLoraConfig:
    """The fields of a PEFT LoraConfig that decide which modules get LoRA and at what scale.

    `target_modules` is a tuple of names (suffix match) or a str (regex, full match).
    `fan_in_fan_out` is accepted and ignored: PEFT itself resets it to False for nn.Linear
    targets, which all Llama projections are, and it never changes the saved tensor shapes.
    """

    r: int
    lora_alpha: float
    use_rslora: bool
    target_modules: tuple[str, ...] | str
    exclude_modules: tuple[str, ...] | str | None
    layers_to_transform: tuple[int, ...] | None
    layers_pattern: tuple[str, ...]
    rank_pattern: dict[str, int]
    alpha_pattern: dict[str, float]
    base_model_name_or_path: str | None
    raw: dict[str, Any]

    def is_targeted(self, name: str) -> bool:
        """Whether PEFT puts LoRA on the module with this full name (`model.layers.0.mlp.up_proj`)."""
        if self.exclude_modules:
            if isinstance(self.exclude_modules, str):
                if re.fullmatch(self.exclude_modules, name):
                    return False
            elif name in self.exclude_modules or any(
                name.endswith(f".{e}") for e in self.exclude_modules
            ):
                return False
        if isinstance(self.target_modules, str):
            return re.fullmatch(self.target_modules, name) is not None
        if name in self.target_modules:
            # PEFT skips the layer filter for an exact full-name match.
            return True
        if not any(name.endswith(f".{t}") for t in self.target_modules):
            return False
        if not self.layers_to_transform:
            return True
        index = _layer_index(name, self.layers_pattern)
        return index is not None and index in self.layers_to_transform

    def rank_and_alpha(self, name: str) -> tuple[int, float]:
        """(r, lora_alpha) for a module, with rank_pattern / alpha_pattern applied as PEFT does:
        the first pattern key `k` in file order for which `(.*\\.)?(k)$` matches the full name."""
        r_key = _pattern_key(self.rank_pattern, name)
        a_key = _pattern_key(self.alpha_pattern, name)
        r = self.rank_pattern[r_key] if r_key is not None else self.r
        alpha = self.alpha_pattern[a_key] if a_key is not None else self.lora_alpha
        return r, alpha

    def scale(self, r: int, alpha: float) -> float:
        """alpha / r, or alpha / sqrt(r) with rsLoRA (peft LoraLayer.update_layer)."""
        return alpha / math.sqrt(r) if self.use_rslora else alpha / r


def _layer_index(name: str, layers_pattern: tuple[str, ...]) -> int | None:
    if not layers_pattern:
        # The lazy `.*?` takes the first numbered segment, as in PEFT.
        match = re.match(r".*?\.[^.]*\.(?P<idx>\d+)\.", name)
    else:
        match = None
        for pattern in layers_pattern:
            match = re.match(rf"(?:^|.*?\.){pattern}\.(?P<idx>\d+)\.", name)
            if match is not None:
                break
    return int(match.group("idx")) if match else None


def _pattern_key(patterns: dict[str, Any], name: str) -> str | None:
    for key in patterns:
        if re.match(rf"(.*\.)?({key})$", name):
            return key
    return None


def parse_peft_config(data: bytes, source: str) -> PeftLoraConfig:
    """Parse and type-check `adapter_config.json` bytes (`source` names the file in messages).

    Raises AdapterFormatError for malformed JSON or fields, AdapterIncompatibleError for a
    peft_type other than LORA, a bias other than "none", or an unsupported LoRA feature.
    """
    try:
        raw = json.loads(data)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise AdapterFormatError(f"{source} is not valid JSON: {e}") from None
    if not isinstance(raw, dict):
        raise AdapterFormatError(f"{source} must hold a JSON object, got {type(raw).__name__}")
    _check_supported(raw, source)
    fields = _Fields(raw, source)
    return PeftLoraConfig(
        r=fields.positive_int("r"),
        lora_alpha=fields.number("lora_alpha", default=8),
        use_rslora=fields.boolean("use_rslora"),
        target_modules=_target_modules(fields),
        exclude_modules=fields.names_or_regex("exclude_modules"),
        layers_to_transform=_layers_to_transform(fields),
        layers_pattern=_layers_pattern(fields),
        rank_pattern={k: fields.check_positive_int(f"rank_pattern[{k!r}]", v)
                      for k, v in fields.mapping("rank_pattern").items()},
        alpha_pattern={k: fields.check_number(f"alpha_pattern[{k!r}]", v)
                       for k, v in fields.mapping("alpha_pattern").items()},
        base_model_name_or_path=fields.optional_str("base_model_name_or_path"),
        raw=raw,
    )


def _check_supported(raw: dict[str, Any], source: str) -> None:
    if "peft_type" not in raw:
        raise AdapterFormatError(f"{source} lacks 'peft_type': not a PEFT adapter config")
    if raw["peft_type"] != "LORA":
        raise AdapterIncompatibleError(
            f"{source}: peft_type {raw['peft_type']!r} is not supported; only 'LORA' adapters"
        )
    bias = raw.get("bias", "none")
    if bias not in (None, "none"):
        raise AdapterIncompatibleError(
            f"{source}: bias={bias!r} is not supported (the base model's biases must stay "
            "frozen); only bias='none'"
        )
    for name, what in _UNSUPPORTED_FIELDS.items():
        if raw.get(name):
            raise AdapterIncompatibleError(
                f"{source}: {name}={raw[name]!r} ({what}) is not supported; plain LoRA only"
            )


def _target_modules(fields: _Fields) -> tuple[str, ...] | str:
    targets = fields.names_or_regex("target_modules")
    if targets is None:
        return _DEFAULT_TARGETS
    if isinstance(targets, str) and targets.lower() == _ALL_LINEAR:
        # PEFT expands "all-linear" to every linear layer except the output head.
        return LORA_MODULES
    if not targets:
        raise AdapterFormatError(f"{fields.source}: target_modules is empty")
    return targets


def _layers_to_transform(fields: _Fields) -> tuple[int, ...] | None:
    value = fields.raw.get("layers_to_transform")
    if value is None or value == []:
        return None
    items = value if isinstance(value, list) else [value]
    return tuple(fields.check_int(f"layers_to_transform[{i}]", v) for i, v in enumerate(items))


def _layers_pattern(fields: _Fields) -> tuple[str, ...]:
    value = fields.names_or_regex("layers_pattern")
    if value is None:
        return ()
    return (value,) if isinstance(value, str) else value


class _Fields:
    """Typed access to config fields; every failure names the file and the field."""

    def __init__(self, raw: dict[str, Any], source: str) -> None:
        self.raw, self.source = raw, source

    def _bad(self, name: str, value: object, expected: str) -> AdapterFormatError:
        return AdapterFormatError(f"{self.source}: {name}={value!r} must be {expected}")

    def check_int(self, name: str, value: object) -> int:
        # bool is an int subclass in Python, but `true` is not a layer index or a rank.
        if isinstance(value, bool) or not isinstance(value, int):
            raise self._bad(name, value, "an integer")
        return value

    def check_positive_int(self, name: str, value: object) -> int:
        number = self.check_int(name, value)
        if number <= 0:
            raise self._bad(name, value, "a positive integer")
        return number

    def check_number(self, name: str, value: object) -> float:
        if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
            raise self._bad(name, value, "a finite number")
        return float(value)

    def positive_int(self, name: str) -> int:
        if name not in self.raw:
            raise AdapterFormatError(f"{self.source} lacks required field {name!r}")
        return self.check_positive_int(name, self.raw[name])

    def number(self, name: str, default: float) -> float:
        return self.check_number(name, self.raw.get(name, default))

    def boolean(self, name: str) -> bool:
        value = self.raw.get(name, False)
        if not isinstance(value, bool):
            raise self._bad(name, value, "true or false")
        return value

    def optional_str(self, name: str) -> str | None:
        value = self.raw.get(name)
        if value is not None and not isinstance(value, str):
            raise self._bad(name, value, "a string or null")
        return value

    def mapping(self, name: str) -> dict[str, Any]:
        """A {regex: value} object such as rank_pattern; every key must compile."""
        value = self.raw.get(name) or {}
        if not isinstance(value, dict):
            raise self._bad(name, value, "an object")
        for key in value:
            try:
                re.compile(key)
            except re.error as e:
                raise self._bad(f"{name} key", key, f"a valid regular expression ({e})") from None
        return value

    def names_or_regex(self, name: str) -> tuple[str, ...] | str | None:
        value = self.raw.get(name)
        if value is None:
            return None
        if isinstance(value, str):
            try:
                re.compile(value)
            except re.error as e:
                raise self._bad(name, value, f"a valid regular expression ({e})") from None
            return value
        if isinstance(value, list) and all(isinstance(v, str) for v in value):
            return tuple(value)
        raise self._bad(name, value, "a list of module names or a regex string")
