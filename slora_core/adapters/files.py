"""Reading an adapter directory once and computing its digest from those same bytes."""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from slora_core.adapters.errors import AdapterFormatError

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
PICKLE_WEIGHTS_FILE = "adapter_model.bin"
# The digest covers these files in this order.
DIGEST_FILES: tuple[str, ...] = (CONFIG_FILE, WEIGHTS_FILE)


@dataclass(frozen=True)
class AdapterFiles:
    """The raw bytes of one adapter directory, as read once from disk."""

    path: Path
    config_bytes: bytes
    weights_bytes: bytes

    @property
    def sha256(self) -> str:
        return digest_bytes({CONFIG_FILE: self.config_bytes, WEIGHTS_FILE: self.weights_bytes})


def digest_bytes(contents: dict[str, bytes]) -> str:
    """sha256 hex digest of the files in DIGEST_FILES order; see `digest_adapter_dir`."""
    h = hashlib.sha256()
    for name in DIGEST_FILES:
        data = contents[name]
        h.update(name.encode("utf-8") + b"\0" + str(len(data)).encode("ascii") + b"\0")
        h.update(data)
    return h.hexdigest()


def read_adapter_files(path: str | os.PathLike[str]) -> AdapterFiles:
    """Read `adapter_config.json` and `adapter_model.safetensors` of a PEFT directory, each once.

    Raises AdapterFormatError naming the path when the directory or a file is missing or
    unreadable, and when only a pickled `adapter_model.bin` is present (never unpickled).
    """
    root = Path(path)
    if not root.is_dir():
        raise AdapterFormatError(f"adapter directory {root} does not exist or is not a directory")
    config_path, weights_path = root / CONFIG_FILE, root / WEIGHTS_FILE
    if not config_path.is_file():
        raise AdapterFormatError(f"{config_path} not found: not a PEFT adapter directory")
    if not weights_path.is_file():
        if (root / PICKLE_WEIGHTS_FILE).exists():
            raise AdapterFormatError(
                f"{root} holds only {PICKLE_WEIGHTS_FILE} (a pickle, which is never loaded); "
                f"re-save the adapter with safe_serialization=True to get {WEIGHTS_FILE}"
            )
        raise AdapterFormatError(f"{weights_path} not found")
    return AdapterFiles(root, _read(config_path), _read(weights_path))


def adapter_files_from_tensors(state_dict: Mapping[str, torch.Tensor],
                               config: Mapping[str, Any] | Any, name: str) -> AdapterFiles:
    """The files `save_pretrained` would write for a PEFT LoRA state dict (as
    `get_peft_model_state_dict` returns it) and its config (a dict or a peft LoraConfig), as
    bytes: the same parser and the same digest as an adapter directory, without a disk. The
    config is written with sorted keys, so one state dict and config give one digest."""
    from safetensors.torch import save

    raw = config.to_dict() if hasattr(config, "to_dict") else dict(config)
    # peft's to_dict leaves sets (target_modules) and enums; JSON takes lists and values.
    text = json.dumps(raw, sort_keys=True, default=_jsonable)
    tensors = {k: v.detach().to("cpu").contiguous() for k, v in state_dict.items()}
    try:
        weights = save(tensors)
    except (ValueError, TypeError) as e:
        raise AdapterFormatError(f"adapter {name!r}: tensors cannot be serialized: {e}") from None
    return AdapterFiles(Path(f"<tensors:{name}>"), text.encode("utf-8"), weights)


def _jsonable(value: Any) -> Any:
    if isinstance(value, set | frozenset):
        return sorted(value)
    if hasattr(value, "value"):  # an enum
        return value.value
    raise TypeError(f"{type(value).__name__} is not JSON serializable")


def digest_adapter_dir(path: str | os.PathLike[str]) -> str:
    """The adapter's sha256 (lowercase hex), covering both files so that e.g. a changed
    `lora_alpha` gives a different digest.

    Byte layout hashed, for each file in the order adapter_config.json, adapter_model.safetensors:
    the file name in UTF-8, a NUL byte, the file's length in bytes as ASCII decimal, a NUL byte,
    then the file's content. To reproduce it without slora::

        h = hashlib.sha256()
        for name in ("adapter_config.json", "adapter_model.safetensors"):
            data = open(os.path.join(path, name), "rb").read()
            h.update(name.encode() + b"\\0" + str(len(data)).encode() + b"\\0" + data)
        h.hexdigest()

    Raises AdapterFormatError like `read_adapter_files`.
    """
    return read_adapter_files(path).sha256


def _read(path: Path) -> bytes:
    try:
        return path.read_bytes()
    except OSError as e:
        raise AdapterFormatError(f"cannot read {path}: {e.strerror or e}") from None
