"""LoRA wraps the base model's linear layers; the model file never mentions LoRA.

`wrap_lora(model, config)` replaces each fused base projection by a `LoraLinear` that runs the
base layer, then adds the multi-LoRA delta of the current step's adapter segments, read from the
page arena through the step context's offset tables.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial

import torch
from torch import nn

from slora_core import ops
from slora_core.config import MODULE_INDEX, ModelConfig
from slora_core.context import PendingExpand, StepContext, defer_expand, get_context
from slora_core.model import LlamaForCausalLM


def round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


@dataclass
class RideRows:
    """A projection's weight with one adapter's A rows appended, and its expand matrix
    (slora_core/lora_ride.py): `weight` [out + modules * rank, in], the base Linear's weight
    a view of its first `out` rows; `b_t` [modules * rank, out], scale * B^T block-diagonal;
    of both, the first modules * rows appended rows in use (module i's block at i * rows).
    The GEMM's output is `width()` columns: out and the appended rows in use rounded up to
    `align` (zero rows past them; `weight` holds out + modules * rank rounded up likewise), so
    that its row stride is a multiple of `align` elements, as Triton's consumers of the
    strided outputs (rotary, attention, rms_norm) need to vectorize their loads
    (RIDE_ROW_ALIGN)."""

    weight: torch.Tensor
    b_t: torch.Tensor
    out: int
    rank: int  # rows per module the buffers hold (the arena's max_rank)
    modules: int  # the projection's modules, each a block of `rows` rows
    # Rows per module in use now (<= rank): the loaded adapter's rank rounded up
    # (SoleAdapterRide.rows_for); the GEMM and the expand read only modules * rows of them.
    rows: int = 0
    # Leave the expand to the op reading the output (qkv: rotary, gate_up: silu_mul), which
    # fuses it in (context.defer_expand); False: one addmm here.
    defer: bool = False
    # Not deferred: the expand as a Triton launch behind the GEMM (slora_kernels.ride_expand,
    # on CUDA) instead of cuBLAS's addmm (SoleAdapterRide.triton_expands says why).
    triton_expand: bool = True
    # The GEMM output's row stride a multiple of this many elements (1: no padding).
    align: int = 1

    def __post_init__(self) -> None:
        self.rows = self.rows or self.rank

    def width(self) -> int:
        """Columns of the GEMM's output: out + modules * rows rounded up to `align`."""
        return round_up(self.out + self.modules * self.rows, self.align)

    def forward(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """x @ W.T (+ bias) + the loaded adapter's delta: one GEMM, then one addmm or the
        expand deferred to the consumer; a strided [T, out] view of the wide output."""
        extra = self.modules * self.rows
        wide = torch.mm(x, self.weight[: self.width()].t())
        y, s, b_t = (wide[:, : self.out], wide[:, self.out : self.out + extra],
                     self.b_t[:extra])
        if bias is not None:
            y.add_(bias)
        if self.defer:
            defer_expand(PendingExpand(y, s, b_t, self.rows))
            return y
        if self.triton_expand and ops._use_triton(y):
            from slora_kernels.ride_expand import expand_add_triton

            return expand_add_triton(y, s, b_t)
        return y.addmm_(s, b_t)


class LoraLinear(nn.Module):
    def __init__(
        self,
        base: nn.Linear,
        layer: int,
        modules: tuple[str, ...],
        out_sizes: tuple[int, ...],
    ) -> None:
        super().__init__()
        if sum(out_sizes) != base.out_features:
            raise ValueError(f"slices {out_sizes} do not cover {base.out_features} outputs")
        self.base = base
        self.layer = layer
        self.module_ids = tuple(MODULE_INDEX[m] for m in modules)
        starts = [sum(out_sizes[:i]) for i in range(len(out_sizes))]
        self.out_slices = tuple(zip(starts, out_sizes, strict=True))
        # Active-module set -> (module ids, output slices) of this layer's launch.
        self._launch: dict[frozenset[int] | None, tuple[tuple[int, ...],
                                                        tuple[tuple[int, int], ...]]] = {}
        # The sole-adapter ride's rows (EngineConfig.ride_sole_adapter), when attached.
        self.ride: RideRows | None = None

    def _launch_modules(self, active: frozenset[int] | None
                        ) -> tuple[tuple[int, ...], tuple[tuple[int, int], ...]]:
        """This layer's modules that some resident adapter targets, with their slices."""
        got = self._launch.get(active)
        if got is None:
            keep = [i for i, m in enumerate(self.module_ids) if active is None or m in active]
            got = (tuple(self.module_ids[i] for i in keep),
                   tuple(self.out_slices[i] for i in keep))
            self._launch[active] = got
        return got

    @property
    def weight(self) -> torch.Tensor:
        return self.base.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        ctx = get_context()
        if ctx.lora_ride and self.ride is not None:
            # Every row reads the adapter loaded in the ride's rows.
            if not self._launch_modules(ctx.lora_modules)[0]:
                return self.base(x)
            return self.ride.forward(x, self.base.bias)
        if ctx.lora is None or ctx.lora_tables is None or ctx.lora.num_segments == 0:
            return self.base(x)
        module_ids, out_slices = self._launch_modules(ctx.lora_modules)
        if not module_ids:
            return self.base(x)
        if ctx.lora_side is not None:
            return self._forked(x, ctx, module_ids, out_slices)
        y = self.base(x)
        self._add_delta(y.view(-1, y.shape[-1]), x.reshape(-1, x.shape[-1]), ctx, module_ids,
                        out_slices)
        return y

    def _forked(self, x: torch.Tensor, ctx: StepContext, module_ids: tuple[int, ...],
                out_slices: tuple[tuple[int, int], ...]) -> torch.Tensor:
        """The base GEMM with the delta's shrinks on `ctx.lora_side` beside it (they read only
        x), then the expands into its output (launched plainly: a programmatic dependent
        launch needs its producer on the same stream)."""
        from slora_kernels.lora import lora_forked, lora_groups

        t, layer, side = ctx.lora_tables, self.layer, ctx.lora_side
        assert t is not None and ctx.lora is not None and side is not None
        groups = lora_groups(x.reshape(-1, x.shape[-1]), t.arena, t.a_offsets[layer],
                             t.b_offsets[layer], t.ranks[layer], t.scales[layer], module_ids,
                             out_slices, ctx.lora, max_rank=t.max_rank or None, pdl=False)
        return lora_forked(groups, side, partial(self.base, x))

    def _add_delta(self, y: torch.Tensor, x: torch.Tensor, ctx: StepContext,
                   module_ids: tuple[int, ...], out_slices: tuple[tuple[int, int], ...]
                   ) -> None:
        t = ctx.lora_tables
        assert t is not None and ctx.lora is not None
        layer = self.layer
        ops.add_lora(
            y, x, t.arena, t.a_offsets[layer], t.b_offsets[layer], t.ranks[layer],
            t.scales[layer], module_ids, out_slices, ctx.lora, max_rank=t.max_rank or None,
            pdl=ctx.lora_pdl,
        )


def wrap_lora(model: LlamaForCausalLM, config: ModelConfig) -> None:
    """Replace qkv_proj, o_proj, gate_up_proj and down_proj of every layer by LoraLinear."""
    q = config.num_attention_heads * config.head_dim
    kv = config.num_key_value_heads * config.head_dim
    inter, hidden = config.intermediate_size, config.hidden_size
    for i, layer in enumerate(model.model.layers):
        attn, mlp = layer.get_submodule("self_attn"), layer.get_submodule("mlp")
        _wrap(attn, "qkv_proj", i, ("q_proj", "k_proj", "v_proj"), (q, kv, kv))
        _wrap(attn, "o_proj", i, ("o_proj",), (hidden,))
        _wrap(mlp, "gate_up_proj", i, ("gate_proj", "up_proj"), (inter, inter))
        _wrap(mlp, "down_proj", i, ("down_proj",), (hidden,))


def _wrap(parent: nn.Module, name: str, layer: int, modules: tuple[str, ...],
          out_sizes: tuple[int, ...]) -> None:
    base = getattr(parent, name)
    if not isinstance(base, nn.Linear):
        raise TypeError(f"layer {layer} {name} is {type(base).__name__}, not a base nn.Linear")
    setattr(parent, name, LoraLinear(base, layer, modules, out_sizes))
