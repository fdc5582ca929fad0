"""S-LoRA-style synthetic workloads: power-law adapter popularity, Gamma arrivals, uniform
lengths, ranks assigned round-robin."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class WorkloadSpec:
    num_adapters: int
    num_requests: int
    alpha: float = 1.0  # power-law exponent of adapter popularity (0 = uniform)
    rate: float = float("inf")  # requests per second; inf = all arrive at t=0
    cv: float = 1.0  # coefficient of variation of inter-arrival times
    input_range: tuple[int, int] = (8, 512)
    output_range: tuple[int, int] = (8, 512)
    ranks: tuple[int, ...] = (16,)
    vocab_size: int = 32000
    seed: int = 0

    def __post_init__(self) -> None:
        if self.num_adapters < 0 or self.num_requests <= 0:
            raise ValueError("num_adapters must be >= 0 and num_requests > 0")
        if self.cv <= 0 or self.rate <= 0:
            raise ValueError("rate and cv must be positive")
        for lo, hi in (self.input_range, self.output_range):
            if not 1 <= lo < hi:
                raise ValueError(f"bad length range [{lo}, {hi})")


@dataclass(frozen=True)
class BenchRequest:
    arrival: float  # seconds after the start
    adapter: int | None  # adapter index, None = base model
    prompt: list[int]
    output_len: int


def adapter_rank(spec: WorkloadSpec, index: int) -> int:
    return spec.ranks[index % len(spec.ranks)]


def generate(spec: WorkloadSpec) -> list[BenchRequest]:
    rng = np.random.default_rng(spec.seed)
    n = spec.num_requests
    if spec.rate == float("inf"):
        arrivals = np.zeros(n)
    else:
        shape = 1.0 / spec.cv**2
        gaps = rng.gamma(shape, 1.0 / (spec.rate * shape), size=n)
        arrivals = np.cumsum(gaps) - gaps[0]
    if spec.num_adapters:
        weights = np.arange(1, spec.num_adapters + 1, dtype=np.float64) ** -spec.alpha
        adapters = rng.choice(spec.num_adapters, size=n, p=weights / weights.sum())
    inputs = rng.integers(*spec.input_range, size=n)
    outputs = rng.integers(*spec.output_range, size=n)
    return [
        BenchRequest(
            arrival=float(arrivals[i]),
            adapter=int(adapters[i]) if spec.num_adapters else None,
            prompt=rng.integers(3, spec.vocab_size, size=int(inputs[i])).tolist(),
            output_len=int(outputs[i]),
        )
        for i in range(n)
    ]


def reuse_batch(batch: int, reuse: float, rng_seed: int = 0) -> list[int]:
    """Adapter indices for `batch` requests where a `reuse` share of the requests use an adapter
    that another request of the batch also uses (the rest are singletons)."""
    if not 0 <= reuse <= 1:
        raise ValueError("reuse must be in [0, 1]")
    shared = int(round(batch * reuse))
    if shared == 1:
        shared = 2 if batch > 1 else 0  # one request cannot share with itself
    singles = batch - shared
    ids = list(range(singles))
    groups = max(1, shared // 4)  # groups of about four requests share one adapter
    ids += [singles + i % groups for i in range(shared)]
    rng = np.random.default_rng(rng_seed)
    rng.shuffle(ids)
    return ids
