"""The compute ops the model calls, bound to Triton kernels on CUDA and torch references
elsewhere. Everything device-specific the model needs goes through here.

The Triton launchers are imported on first CUDA use only, so CPU processes never import Triton
(and the kernel tests can choose Triton's interpreter before anything imports a kernel).
"""

from __future__ import annotations

import torch

from slora_core.context import take_expand
from slora_kernels.attention_reference import paged_attention_reference, write_kv_reference
from slora_kernels.fused_reference import rms_norm_reference, rotary_reference, silu_mul_reference
from slora_kernels.lora_meta import LoraMeta
from slora_kernels.lora_reference import add_lora_reference


def _use_triton(t: torch.Tensor) -> bool:
    return t.is_cuda


def write_kv(k_cache: torch.Tensor, v_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
             slot_mapping: torch.Tensor) -> None:
    """k_cache/v_cache rows at slot_mapping (>= 0) = k/v (see `write_kv_reference`)."""
    if _use_triton(k):
        from slora_kernels.write_kv import write_kv_triton

        write_kv_triton(k_cache, v_cache, k, v, slot_mapping)
    else:
        write_kv_reference(k_cache, v_cache, k, v, slot_mapping)


def paged_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                    block_tables: torch.Tensor, seq_lens: torch.Tensor,
                    query_starts: torch.Tensor, scale: float, *,
                    max_query_len: int | None = None) -> torch.Tensor:
    """Causal paged attention (see `paged_attention_reference`). On CUDA, `max_query_len=1`
    (a decode-only step) selects the context-split decode kernel; it must then be true."""
    if _use_triton(q):
        from slora_kernels.paged_attention import paged_attention_triton

        return paged_attention_triton(q, k_cache, v_cache, block_tables, seq_lens,
                                      query_starts, scale, max_query_len=max_query_len)
    return paged_attention_reference(q, k_cache, v_cache, block_tables, seq_lens, query_starts,
                                     scale)


def add_lora(y: torch.Tensor, x: torch.Tensor, arena: torch.Tensor, a_offsets: torch.Tensor,
             b_offsets: torch.Tensor, ranks: torch.Tensor, scales: torch.Tensor,
             module_ids: tuple[int, ...], out_slices: tuple[tuple[int, int], ...],
             meta: LoraMeta, *, max_rank: int | None = None, pdl: bool | None = None) -> None:
    """y += the multi-LoRA delta (see `add_lora_reference`). On CUDA, `max_rank` (a bound on
    every rank in the tables) spares the kernels a host sync that CUDA graphs forbid; `pdl`
    overrides the kernels' programmatic dependent launch (`slora_kernels.lora.LoraTiles.pdl`)."""
    if _use_triton(x):
        from slora_kernels.lora import add_lora_triton

        add_lora_triton(y, x, arena, a_offsets, b_offsets, ranks, scales, module_ids,
                        out_slices, meta, max_rank=max_rank, pdl=pdl)
    else:
        add_lora_reference(y, x, arena, a_offsets, b_offsets, ranks, scales, module_ids,
                           out_slices, meta)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float,
             residual: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(norm(x), None), or with `residual`: residual += x in place, (norm(residual), residual)."""
    if _use_triton(x):
        from slora_kernels.rmsnorm import rms_norm_triton

        return rms_norm_triton(x, weight, eps, residual)
    return rms_norm_reference(x, weight, eps, residual)


def rotary(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> None:
    """Rotate q [T, H, D] and k [T, Hkv, D] in place by cos/sin [T, D]. When q and k are views
    of a ride projection's output whose expand was deferred (context.defer_expand), the expand
    is applied first: fused into the rotation (q, k and the v heads after them) on CUDA."""
    pending = take_expand(q)
    if pending is not None:
        if _use_triton(q):
            from slora_kernels.rotary import rotary_expand_triton

            # q, k and v heads of the fused output (the launcher refuses another layout).
            rotary_expand_triton(pending.out, pending.s, pending.b_t, pending.rank, q.shape[1],
                                 k.shape[1], cos, sin)
            return
        pending.apply()
    if _use_triton(q):
        from slora_kernels.rotary import rotary_triton

        rotary_triton(q, k, cos, sin)
    else:
        rotary_reference(q, k, cos, sin)


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """[T, 2I] -> silu(gate) * up, [T, I]. When gate_up is a ride projection's output whose
    expand was deferred (context.defer_expand), the expand is applied first: fused in on CUDA."""
    pending = take_expand(gate_up)
    if pending is not None:
        if _use_triton(gate_up):
            from slora_kernels.silu_mul import silu_mul_expand_triton

            return silu_mul_expand_triton(gate_up, pending.s, pending.b_t, pending.rank)
        pending.apply()
    if _use_triton(gate_up):
        from slora_kernels.silu_mul import silu_mul_triton

        return silu_mul_triton(gate_up)
    return silu_mul_reference(gate_up)


def linear_float32(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x @ weight.T accumulated in float32 and returned in float32: a 16-bit GEMM's float32
    result is not rounded to x's dtype on the way out (on CUDA, cuBLAS writes float32 outputs
    from 16-bit inputs: `mm` with `out_dtype`)."""
    if x.dtype == torch.float32:
        return torch.nn.functional.linear(x, weight)
    if x.is_cuda:
        return torch.mm(x, weight.t(), out_dtype=torch.float32)
    return torch.nn.functional.linear(x.float(), weight.float())
