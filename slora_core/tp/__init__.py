"""Tensor parallelism: one engine spread over the GPUs of a host (DESIGN section 5).

Rank 0 runs the whole `LLMEngine` (scheduler, sampler); every rank holds a Megatron-style shard
of the base model and of each resident adapter, in its own page arena. See
docs/tensor_parallel.md for the sharding scheme.
"""

from slora_core.tp.group import TPGroup
from slora_core.tp.shard import TPShard

__all__ = ["TPGroup", "TPShard"]
