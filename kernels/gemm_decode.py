"""Weight-streaming GEMM for small batches: y = x @ w.T (nn.Linear without bias).

Shapes: x [M, K] with M <= 256 (rows of any stride, last dimension contiguous); w [N, K]
contiguous (nn.Linear's weight layout); y [M, N] (rows of any stride, last dimension
contiguous), all of one dtype (float16, bfloat16 or float32). Products accumulate in float32
(float32 inputs through exact float32 dots, not tf32) and y is rounded once to the dtype.

At decode batch sizes the GEMM reads each weight once and is bound by HBM bandwidth, so the grid
is laid over the weight: program (t, j) of the `cdiv(N, block_n) * split_k` programs streams
w[t*block_n : +block_n, its K chunk] once, through a software pipeline `num_stages` deep, and
multiplies it by all M rows of x (padded to BLOCK_M = the next power of two >= 16; x is small
and stays in the L2). The tile is computed transposed, acc[BLOCK_N, BLOCK_M] = w_tile @ x.T, so
the weight rows fill the tensor cores' tall side however few rows x has.

With split_k > 1 the K splits of one column tile meet in the same launch: each writes its
float32 partial tile to a workspace and increments the tile's counter (acq_rel atomic); the
program that sees the count reach split_k - 1 adds the partials in split order (its own read
back as well, so the sum is the same whichever program arrives last), writes y and puts the
counter back to 0. Workspace and counters are allocated once per (device, shape, tiles) and
cached, so a call needs no host work and replays inside a CUDA graph. Two calls of one shape
must therefore not run at the same time on different streams.
"""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

MAX_M = 256
# Shared memory a program's pipeline buffers may take (H100/H200 allow 227 KB a block; the rest
# is left for the epilogue's layout conversions), and a multiprocessor's total.
SMEM_BUDGET = 192 * 1024
SMEM_PER_SM = 228 * 1024
MAX_SPLIT_K = 16
_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


@dataclass(frozen=True)
class GemmDecodeConfig:
    """Launch shape of `linear_decode`: column tile, K step, K splits, warps, pipeline depth."""

    block_n: int = 128
    block_k: int = 128
    split_k: int = 1
    num_warps: int = 4
    num_stages: int = 4

    def __post_init__(self) -> None:
        for name in ("block_n", "block_k"):
            value = getattr(self, name)
            if value < 16 or value & (value - 1):
                raise ValueError(f"{name} must be a power of two >= 16, got {value}")
        if self.num_warps not in (1, 2, 4, 8, 16):
            raise ValueError(f"num_warps must be a power of two <= 16, got {self.num_warps}")
        if not 1 <= self.split_k <= 64:
            raise ValueError(f"split_k must be in 1..64, got {self.split_k}")
        if self.num_stages < 1:
            raise ValueError(f"num_stages must be >= 1, got {self.num_stages}")


def block_m_for(m: int) -> int:
    """The padded row count the kernel computes for M rows: the next power of two >= 16."""
    return max(16, triton.next_power_of_2(m))


@functools.lru_cache(maxsize=1024)
def pick_config(m: int, n: int, k: int, num_sms: int, *, elem_bytes: int = 2,
                block_n: int | None = None, block_k: int | None = None,
                num_stages: int | None = None) -> GemmDecodeConfig:
    """A config for y[m, n] = x[m, k] @ w[n, k].T on `num_sms` multiprocessors.

    Column tiles of 64 or 128 (see below), K steps of 128 (64 from 128 rows or for float32),
    as many pipeline stages (2..5) as fit SMEM_BUDGET, and the split_k whose
    `cdiv(n, block_n) * split_k` programs fill whole waves best (occupancy estimated from the
    shared memory), counting K chunks of unequal length as waste; at most about two waves
    unless one split already exceeds that. `block_n`, `block_k` and `num_stages` fix those
    choices (the benchmark's sweep) and leave split_k to the same rule."""
    bm = block_m_for(m)
    if block_n is None:
        # From one H200 sweep at M=64 (bench.gemm_decode): 64-wide column tiles beat 128 when
        # both fill the waves alike, but not when the 128-wide tiles fit in one wave and the
        # 64-wide ones spill into a second (qkv); 16 rows stream fine in 128-wide tiles, and
        # from 128 rows the wider tile reads x from the L2 half as often.
        fits = triton.cdiv(n, 128) <= num_sms < triton.cdiv(n, 64)
        block_n = 64 if 16 < bm <= 64 and not fits else 128
    bn = block_n
    bk = block_k or (64 if elem_bytes > 2 or bm >= 128 else 128)
    stage_bytes = (bn + bm) * bk * elem_bytes
    stages = num_stages or max(2, min(5, SMEM_BUDGET // stage_bytes))
    warps = 8 if bn * bm >= 128 * 128 else 4
    slots = num_sms * max(1, SMEM_PER_SM // (stages * stage_bytes))
    tiles = triton.cdiv(n, bn)
    k_steps = triton.cdiv(k, bk)
    best, best_score = 1, -1.0
    for split in range(1, min(MAX_SPLIT_K, k_steps) + 1):
        programs = tiles * split
        if split > 1 and programs > 2 * slots:
            break
        waves = programs / slots
        fill = waves / -(-programs // slots)
        balance = k_steps / (split * triton.cdiv(k_steps, split))
        score = fill * balance
        if score > best_score + 1e-3:
            best, best_score = split, score
    return GemmDecodeConfig(block_n=bn, block_k=bk, split_k=best, num_warps=warps,
                            num_stages=stages)


# M changes with every batch: kept out of the specialization so that a new batch size within
# one BLOCK_M reuses the compiled kernel.
@triton.jit(do_not_specialize=["M"])
def _linear_decode_kernel(
    x_ptr, w_ptr, y_ptr, ws_ptr, counter_ptr,
    M, N, K, stride_xm, stride_ym,
    DOT_PRECISION: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr, SPLIT_K: tl.constexpr, EVEN_K: tl.constexpr,
):
    pid = tl.program_id(0)
    tile = pid // SPLIT_K
    split = pid % SPLIT_K
    k_chunk = tl.cdiv(tl.cdiv(K, BLOCK_K), SPLIT_K) * BLOCK_K
    k_lo = split * k_chunk
    k_hi = tl.minimum(k_lo + k_chunk, K)

    offs_n = tile * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_m = tl.arange(0, BLOCK_M)
    # Rows past N or M wrap onto real rows: every load is in bounds and unmasked, and the
    # padded outputs they produce are never stored.
    rows_w = offs_n % N
    rows_x = offs_m % M
    offs_k = k_lo + tl.arange(0, BLOCK_K)
    w_ptrs = w_ptr + rows_w.to(tl.int64)[:, None] * K + offs_k[None, :]
    x_ptrs = x_ptr + rows_x[:, None] * stride_xm + offs_k[None, :]

    acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    for k0 in range(k_lo, k_hi, BLOCK_K):
        if EVEN_K:
            w_tile = tl.load(w_ptrs)
            x_tile = tl.load(x_ptrs)
        else:
            mask_k = (k0 + tl.arange(0, BLOCK_K)) < K
            w_tile = tl.load(w_ptrs, mask=mask_k[None, :], other=0.0)
            x_tile = tl.load(x_ptrs, mask=mask_k[None, :], other=0.0)
        acc += tl.dot(w_tile, tl.trans(x_tile), input_precision=DOT_PRECISION)
        w_ptrs += BLOCK_K
        x_ptrs += BLOCK_K

    y_ptrs = y_ptr + offs_m[None, :] * stride_ym + offs_n[:, None]
    y_mask = (offs_n[:, None] < N) & (offs_m[None, :] < M)
    if SPLIT_K == 1:
        tl.store(y_ptrs, acc.to(y_ptr.dtype.element_ty), mask=y_mask)
    else:
        # Workspace [tiles, SPLIT_K, BLOCK_N, BLOCK_M] float32, whole tiles (no masks).
        local = tl.arange(0, BLOCK_N)[:, None] * BLOCK_M + offs_m[None, :]
        tile_ws = ws_ptr + tile.to(tl.int64) * (SPLIT_K * BLOCK_N * BLOCK_M)
        tl.store(tile_ws + split * (BLOCK_N * BLOCK_M) + local, acc)
        # Every thread's partial is written before the one thread that runs the atomic
        # releases them to the other programs.
        tl.debug_barrier()
        arrived = tl.atomic_add(counter_ptr + tile, 1, sem="acq_rel", scope="gpu")
        if arrived == SPLIT_K - 1:
            # The partials in split order, this program's own re-read too: y is the same
            # whichever program arrives last, and `acc` is dead here (registers for the sum).
            # .cg: read at the L2, where the other programs' partials are.
            total = tl.load(tile_ws + local, cache_modifier=".cg")
            for j in range(1, SPLIT_K):
                total += tl.load(tile_ws + j * (BLOCK_N * BLOCK_M) + local, cache_modifier=".cg")
            tl.store(y_ptrs, total.to(y_ptr.dtype.element_ty), mask=y_mask)
            # Every split of this tile has arrived: reset for the next launch (graph replay).
            tl.atomic_xchg(counter_ptr + tile, 0, sem="relaxed", scope="gpu")


_WORKSPACES: dict[tuple[object, ...], tuple[torch.Tensor, torch.Tensor]] = {}


def _workspace(device: torch.device, tiles: int, split_k: int, block_n: int,
               block_m: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The split-K partials buffer and zeroed per-tile counters for one launch shape, allocated
    on first use and cached. Inside a CUDA graph capture a missing pair is allocated for that
    call alone (its zeroing is captured with it and runs on every replay) and not cached, as
    memory from the graph's pool with counters that were never zeroed outside it would be."""
    key = (device, tiles, split_k, block_n, block_m)
    pair = _WORKSPACES.get(key)
    if pair is None:
        pair = (torch.empty(tiles * split_k * block_n * block_m, dtype=torch.float32,
                            device=device),
                torch.zeros(tiles, dtype=torch.int32, device=device))
        if not (device.type == "cuda" and torch.cuda.is_current_stream_capturing()):
            _WORKSPACES[key] = pair
    return pair


@functools.lru_cache(maxsize=16)
def _num_sms(device: torch.device) -> int:
    if device.type != "cuda":
        return 4  # the CPU interpreter: any count works
    return torch.cuda.get_device_properties(device).multi_processor_count


def linear_decode(
    x: torch.Tensor,
    w: torch.Tensor,
    out: torch.Tensor | None = None,
    *,
    config: GemmDecodeConfig | None = None,
) -> torch.Tensor:
    """y = x @ w.T for x [M <= 256, K] and w [N, K] (see module docstring), written into `out`
    when given ([M, N], x's dtype) and returned. `config` defaults to `pick_config` for the
    shape on this device's multiprocessor count."""
    _check_inputs(x, w, out)
    m, k = x.shape
    n = w.shape[0]
    if out is None:
        out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    if m == 0 or n == 0:
        return out
    if k == 0:
        return out.zero_()
    if config is None:
        config = pick_config(m, n, k, _num_sms(x.device), elem_bytes=x.element_size())
    block_m = block_m_for(m)
    tiles = triton.cdiv(n, config.block_n)
    if config.split_k > 1:
        ws, counters = _workspace(x.device, tiles, config.split_k, config.block_n, block_m)
    else:
        ws, counters = out, out  # unused by the SPLIT_K == 1 kernel
    _linear_decode_kernel[(tiles * config.split_k,)](
        x, w, out, ws, counters, m, n, k, x.stride(0), out.stride(0),
        DOT_PRECISION="ieee" if x.dtype == torch.float32 else "tf32",
        BLOCK_M=block_m, BLOCK_N=config.block_n, BLOCK_K=config.block_k,
        SPLIT_K=config.split_k, EVEN_K=k % config.block_k == 0,
        num_warps=config.num_warps, num_stages=config.num_stages,
    )
    return out


def _check_inputs(x: torch.Tensor, w: torch.Tensor, out: torch.Tensor | None) -> None:
    if x.dim() != 2 or w.dim() != 2:
        raise ValueError(f"x [M, K] and w [N, K] must be 2-D, got {tuple(x.shape)} and "
                         f"{tuple(w.shape)}")
    m, k = x.shape
    n = w.shape[0]
    if m > MAX_M:
        raise ValueError(f"linear_decode takes at most {MAX_M} rows, got M={m}")
    if w.shape[1] != k:
        raise ValueError(f"x {tuple(x.shape)} and w {tuple(w.shape)}: K differs")
    if x.dtype not in _DTYPES or w.dtype != x.dtype:
        raise ValueError(f"x and w must share one of {_DTYPES}, got {x.dtype} and {w.dtype}")
    if w.device != x.device:
        raise ValueError(f"x on {x.device} but w on {w.device}")
    if x.device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
        raise ValueError(f"linear_decode runs on CUDA tensors (or the CPU under "
                         f"TRITON_INTERPRET=1), got {x.device}")
    if not w.is_contiguous():
        raise ValueError(f"w must be contiguous [N, K], got strides {w.stride()}")
    if k > 1 and x.stride(1) != 1:
        raise ValueError(f"x's last dimension must be contiguous, got strides {x.stride()}")
    if out is not None:
        if out.shape != (m, n) or out.dtype != x.dtype or out.device != x.device:
            raise ValueError(f"out must be [{m}, {n}] {x.dtype} on {x.device}, got "
                             f"{tuple(out.shape)} {out.dtype} on {out.device}")
        if n > 1 and out.stride(1) != 1:
            raise ValueError(f"out's last dimension must be contiguous, got {out.stride()}")
