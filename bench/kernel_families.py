"""Grouping profiled kernels by name into families (GEMM, attention, LoRA, ...)."""

from __future__ import annotations

Families = tuple[tuple[str, tuple[str, ...]], ...]


def family_of(name: str, families: Families) -> str:
    """The first of `families` one of whose name fragments `name` holds (any case), else
    "other"."""
    low = name.lower()
    for fam, keys in families:
        if any(k in low for k in keys):
            return fam
    return "other"
