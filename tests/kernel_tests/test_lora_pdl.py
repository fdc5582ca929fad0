"""Programmatic dependent launch of the LoRA expand (`LoraTiles.pdl`, `RowTiles.pdl`): the
expand may start while its shrink runs and waits only to read the shrink's sums.

On the CPU (Triton's interpreter) the option is ignored: the launches are the plain ones, bit
for bit. On a Hopper GPU the expand really overlaps the shrink; a wait placed after a read of
the partial sums would add stale or half-written sums, so the GPU test replays a CUDA graph of
many launches (as decode graphs capture them), each shrink long (K 4096, many splits), and
checks every output against the float64 reference."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from slora_kernels.lora import DECODE_TILES, add_lora_triton
from slora_kernels.lora_common import pdl_supported
from slora_kernels.lora_meta import DECODE_BLOCK_M, ROW_BLOCK_M
from slora_kernels.lora_reference import add_lora_reference
from slora_kernels.lora_rows import RowTiles
from tests.kernel_tests.helpers import (
    DEVICE,
    ON_GPU,
    TOLERANCE,
    LoraCase,
    build_lora_case,
    generator,
    randn,
    rel_err,
)

QKV = (0, 1, 2)
TILES = {"tiles": DECODE_TILES, "tiles_early_loads": dataclasses.replace(
    DECODE_TILES, early_loads=True), "rows": RowTiles()}
GPU_PDL = ON_GPU and pdl_supported(DEVICE)


def _case(kind: str, slots: list[int], adapters: int, k: int, out: int, rank: int,
          dtype: torch.dtype, seed: int) -> tuple[LoraCase, tuple[tuple[int, int], ...]]:
    gen = generator(seed)
    rank_of = {(s, m): rank for s in range(adapters) for m in QKV}
    case = build_lora_case(slots, adapters, k, dict.fromkeys(QKV, out), rank_of, dtype, gen,
                           aligned=True,
                           block_m=ROW_BLOCK_M if kind == "rows" else DECODE_BLOCK_M)
    return case, tuple((i * out, out) for i in range(len(QKV)))


def test_pdl_is_never_used_off_hopper_or_under_the_interpreter() -> None:
    assert not pdl_supported(torch.device("cpu"))
    if not ON_GPU:  # conftest runs kernels under the interpreter here
        assert not pdl_supported(torch.device("cuda"))


@pytest.mark.parametrize("kind", list(TILES))
def test_pdl_requested_where_unsupported_runs_the_plain_launches(kind: str) -> None:
    """`pdl=True` off Hopper (or under the interpreter) changes nothing: same bits."""
    if GPU_PDL:
        pytest.skip("this GPU supports programmatic dependent launch")
    dtype = torch.float16
    slots = [0, 0, 1, 2, -1, 1, 3, 3]
    case, slices = _case(kind, slots, 4, 64, 32, 16, dtype, seed=3)
    gen = generator(4)
    x = randn(len(slots), 64, dtype=dtype, gen=gen)
    y0 = randn(len(slots), 96, dtype=dtype, gen=gen)
    outs = []
    for pdl in (False, True):
        y = y0.clone()
        add_lora_triton(y, x, case.arena, case.a_offsets, case.b_offsets, case.ranks,
                        case.scales, QKV, slices, case.meta, max_rank=64, tiles=TILES[kind],
                        pdl=pdl)
        outs.append(y)
    assert torch.equal(outs[0], outs[1])
    assert not torch.equal(outs[0], y0)


@pytest.mark.skipif(not GPU_PDL, reason="needs a GPU with programmatic dependent launch")
@pytest.mark.parametrize("kind", list(TILES))
@pytest.mark.parametrize(("rows", "adapters"), [(64, 1), (64, 64), (256, 16)])
def test_pdl_expand_waits_for_every_partial_sum_in_graph_replays(kind: str, rows: int,
                                                                 adapters: int) -> None:
    """Eight launches over distinct inputs captured in one graph, replayed five times; every
    y against the float64 reference each time (y restored between replays)."""
    if kind == "rows" and adapters < rows // 2:
        pytest.skip("the row kernels serve adapters of at most two rows")
    dtype, k, out, calls = torch.float16, 4096, 1024, 8
    slots = sorted(i % adapters for i in range(rows))
    case, slices = _case(kind, slots, adapters, k, out, 64, dtype, seed=rows + adapters)
    gen = generator(7)
    xs = [randn(rows, k, dtype=dtype, gen=gen) for _ in range(calls)]
    y0s = [randn(rows, 3 * out, dtype=dtype, gen=gen) for _ in range(calls)]
    ys = [y.clone() for y in y0s]
    args = (case.arena, case.a_offsets, case.b_offsets, case.ranks, case.scales, QKV, slices,
            case.meta)

    def launch_all() -> None:
        for x, y in zip(xs, ys, strict=True):
            add_lora_triton(y, x, *args, max_rank=64, tiles=TILES[kind], pdl=True)

    launch_all()  # compiles; also checked below as an eager run
    refs = []
    for x, y0 in zip(xs, y0s, strict=True):
        ref = y0.double()
        add_lora_reference(ref, x.double(), case.arena.double(), *args[1:])
        refs.append(ref)
    _check_all(ys, y0s, refs, dtype)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        launch_all()
    for _ in range(5):
        for y, y0 in zip(ys, y0s, strict=True):
            y.copy_(y0)
        graph.replay()
        torch.cuda.synchronize()
        _check_all(ys, y0s, refs, dtype)


def _check_all(ys: list[torch.Tensor], y0s: list[torch.Tensor], refs: list[torch.Tensor],
               dtype: torch.dtype) -> None:
    for i, (y, y0, ref) in enumerate(zip(ys, y0s, refs, strict=True)):
        err = rel_err(y.double() - y0.double(), ref - y0.double())
        assert err < TOLERANCE[dtype] * 4, f"launch {i}: delta error {err:.2e}"
