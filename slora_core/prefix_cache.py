"""Content addresses of full KV pages (automatic prefix caching, issue 33).

A page holding tokens [i * block_size, (i + 1) * block_size) of a sequence is addressed by

    hash_i = sha256(hash_{i-1}, identity, the page's token ids)      (hash_{-1} = empty)

where `identity` names what computed the KV: `("base", model digest)` or `("lora", adapter
content digest)`, domain-tagged and length-prefixed, so base and adapter pages, two versions
of one adapter, and two adapters whose names collide never share a page. Never a name, never
a string a client chooses. sha256 rather than Python's hash(): a prompt crafted to collide
with another tenant's page would read that tenant's KV.
"""

from __future__ import annotations

import hashlib
import json
from array import array
from collections.abc import Sequence

import torch

from slora_core.config import ModelConfig


def base_identity(model_digest: str) -> bytes:
    return _identity(b"base", model_digest)


def lora_identity(adapter_digest: str) -> bytes:
    return _identity(b"lora", adapter_digest)


def _identity(domain: bytes, digest: str) -> bytes:
    data = digest.encode("utf-8")
    return domain + b"\0" + len(data).to_bytes(4, "little") + data


def block_hash(parent: bytes, identity: bytes, tokens: Sequence[int]) -> bytes:
    """The content address of one full page (see the module docstring)."""
    h = hashlib.sha256()
    h.update(len(parent).to_bytes(1, "little") + parent)
    h.update(len(identity).to_bytes(4, "little") + identity)
    h.update(array("q", tokens).tobytes())
    return h.digest()


def model_digest(model: ModelConfig, dtype: torch.dtype) -> str:
    """The base model's identity within one engine: its config and dtype. Pages are cached in
    one engine's arena only, computed by the one set of base weights it loaded, so this need
    only tell apart what one engine serves; the `base` domain keeps it apart from adapters."""
    text = json.dumps({"config": model.raw or repr(model), "dtype": str(dtype)}, sort_keys=True,
                      default=str)
    return hashlib.sha256(text.encode("utf-8")).hexdigest()
