"""Pieces shared by the LoRA shrink and expand kernels."""

from __future__ import annotations

import os
from functools import lru_cache

import torch
import triton
import triton.language as tl

from slora_kernels.lora_meta import LoraMeta

# The kernels take module ids and output slices as scalar arguments (no per-call host-to-device
# copy, so launches can be captured in CUDA graphs); three covers q,k,v and gate,up.
MAX_MODULES_PER_LAUNCH = 3


@triton.jit
def release_dependents(LAUNCH_DEPENDENTS: tl.constexpr):
    """Programmatic dependent launch, producer side: the next kernel of the stream, launched
    with `launch_pdl`, may be scheduled now (it waits in `wait_for_producer` before it reads
    what this one writes)."""
    if LAUNCH_DEPENDENTS:
        tl.extra.cuda.gdc_launch_dependents()


@triton.jit
def wait_for_producer(USE_PDL: tl.constexpr):
    """Programmatic dependent launch, consumer side: block until the previous kernel of the
    stream has finished and its writes are visible. Loads of what it does not write (tables,
    adapter weights, the base GEMM's output it launched after) may come before."""
    if USE_PDL:
        tl.extra.cuda.gdc_wait()


@triton.jit
def select3(i, v0, v1, v2):
    """v_i for a program-uniform index i in {0, 1, 2}."""
    return tl.where(i == 0, v0, tl.where(i == 1, v1, v2))


@triton.jit
def tile_entry(tile, mod_i, tile_segs_ptr, seg_slots_ptr, ranks_ptr, mod0, mod1, mod2,
               table_stride, MAX_RANK: tl.constexpr):
    """A tile list entry's (segment, slot, module id, rank clipped to MAX_RANK, whether the
    entry is used) for module index `mod_i`; an unused entry (segment -1) reads nothing else
    (the segment arrays may even be empty) and has rank 0."""
    seg = tl.load(tile_segs_ptr + tile)
    real = seg >= 0
    slot = tl.load(seg_slots_ptr + seg, mask=real, other=0).to(tl.int64)
    mod = select3(mod_i, mod0, mod1, mod2)
    rank = tl.minimum(tl.load(ranks_ptr + slot * table_stride + mod, mask=real, other=0),
                      MAX_RANK)
    return seg, slot, mod, rank, real


@triton.jit
def segment_rows(rows_ptr, positions, mask, GATHER_ROWS: tl.constexpr):
    """The token rows (int64) at these positions of the step's adapter order: the positions
    themselves when tokens come grouped by adapter, else read from the sorted row list."""
    if GATHER_ROWS:
        return tl.load(rows_ptr + positions, mask=mask, other=0).to(tl.int64)
    return positions.to(tl.int64)


def check_expand_operands(s: torch.Tensor, b_t: torch.Tensor, rows: int, k: int, n: int,
                          dtype: torch.dtype, what: str) -> None:
    """Raise ValueError unless the ride's shrink output s is [rows, k] and its expand matrix
    b_t [k, n], both in `dtype` with unit column stride; `what` names k in the message."""
    if s.shape != (rows, k) or b_t.shape != (k, n) or s.stride(-1) != 1 \
            or b_t.stride(-1) != 1 or s.dtype != dtype or b_t.dtype != dtype:
        raise ValueError(f"s must be [T, {what}] = {(rows, k)} and b_t [{what}, N] = {(k, n)} "
                         f"in {dtype}, unit column stride; got {tuple(s.shape)} {s.dtype}, "
                         f"{tuple(b_t.shape)} {b_t.dtype}")


def pdl_supported(device: torch.device) -> bool:
    """Whether launches on `device` can overlap their predecessor (programmatic dependent
    launch, `griddepcontrol`): compiled kernels (not Triton's interpreter) on a GPU of compute
    capability 9.0 (Hopper) or newer."""
    if device.type != "cuda" or os.environ.get("TRITON_INTERPRET", "0") == "1":
        return False
    return _capability_major(device.index if device.index is not None
                             else torch.cuda.current_device()) >= 9


@lru_cache(maxsize=16)
def _capability_major(index: int) -> int:
    return torch.cuda.get_device_capability(index)[0]


def pdl_options(pdl: bool) -> dict[str, bool]:
    """Launch options of a kernel that waits for its producer (`wait_for_producer`): launched
    as a programmatic dependent when `pdl`, plainly otherwise (the interpreter takes no
    `launch_pdl`)."""
    return {"launch_pdl": True} if pdl else {}


def dot_precision(dtype: torch.dtype) -> str:
    """float32 models get exact float32 dots. With 16-bit models the shrink's operands are exact
    in any mode and the expand's float32 intermediate goes through tf32, whose 10-bit mantissa
    matches fp16's, so the delta keeps the output dtype's precision."""
    return "ieee" if dtype == torch.float32 else "tf32"


def check_tables(arena: torch.Tensor, x: torch.Tensor, offsets: torch.Tensor,
                 ranks: torch.Tensor) -> None:
    """Raise ValueError unless the arena and one layer's offset/rank tables fit the kernels.
    The arena holds the activations' dtype."""
    if arena.dim() != 1 or arena.dtype != x.dtype:
        raise ValueError(f"arena must be 1-D of dtype {x.dtype}, got {arena.dtype} "
                         f"{tuple(arena.shape)}")
    if offsets.dtype != torch.int64 or ranks.dtype != torch.int32:
        raise ValueError("offset tables must be int64 and ranks int32")
    if (offsets.shape != ranks.shape or not offsets.is_contiguous()
            or not ranks.is_contiguous()):
        raise ValueError("offset and rank tables must be contiguous [num_slots, num_modules]")
    if arena.device != x.device or offsets.device != x.device:
        raise ValueError("arena, tables and activations must be on one device")


def check_rows(x: torch.Tensor, y: torch.Tensor, meta: LoraMeta) -> None:
    """Raise ValueError unless x, y and the step's segment metadata have one token count."""
    if x.shape[0] != y.shape[0] or meta.token_slots.shape[0] != x.shape[0]:
        raise ValueError(f"x {tuple(x.shape)}, y {tuple(y.shape)} and the segment metadata "
                         "disagree on the token count")


def check_slices(y: torch.Tensor, module_ids: tuple[int, ...],
                 out_slices: tuple[tuple[int, int], ...]) -> None:
    """Raise ValueError unless each module has one output slice inside y's columns."""
    if len(out_slices) != len(module_ids) or not module_ids:
        raise ValueError(f"{len(module_ids)} modules but {len(out_slices)} output slices")
    for start, size in out_slices:
        if start < 0 or size <= 0 or start + size > y.shape[1]:
            raise ValueError(f"slice ({start}, {size}) outside y's {y.shape[1]} columns")


def check_scales(scales: torch.Tensor, ranks: torch.Tensor) -> None:
    if scales.dtype != torch.float32 or scales.shape != ranks.shape or not scales.is_contiguous():
        raise ValueError("scales must be a contiguous float32 table shaped like ranks")


def check_buf(buf: torch.Tensor, tokens: int, num_modules: int, against: str) -> None:
    """Raise ValueError unless `buf` is the float32 [split_k, T, num_modules, max_rank]
    intermediate for `tokens` tokens (`against` names the tensor T came from in the message)."""
    if buf.dim() != 4 or buf.dtype != torch.float32 or not buf.is_contiguous():
        raise ValueError("buf must be a contiguous float32 [split_k, T, num_modules, max_rank]")
    if buf.shape[1] != tokens or buf.shape[2] != num_modules:
        raise ValueError(f"buf {tuple(buf.shape)} does not match {against} and "
                         f"{num_modules} modules")
