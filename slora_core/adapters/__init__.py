"""PEFT LoRA adapters: reading, digest and validation against a base model.

One validator shared by the engine (before adapter pages are filled) and the control plane's
registry (before a version is committed), so both accept and refuse exactly the same adapters.
"""

from slora_core.adapters.errors import (
    AdapterError,
    AdapterFormatError,
    AdapterIncompatibleError,
)
from slora_core.adapters.files import digest_adapter_dir
from slora_core.adapters.loader import LoraAdapter, LoraWeight, load_adapter

__all__ = [
    "AdapterError",
    "AdapterFormatError",
    "AdapterIncompatibleError",
    "LoraAdapter",
    "LoraWeight",
    "digest_adapter_dir",
    "load_adapter",
]
