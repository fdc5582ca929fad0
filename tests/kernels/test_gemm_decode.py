"""linear_decode (y = x @ w.T, the weight-streaming decode GEMM) against float64 torch: row
counts below, at and past a BLOCK_M, column counts that leave a partial tile, K that leaves a
partial step, split-K in one launch (twice in a row: the per-tile counters must have been put
back to 0), strided x and out rows, the default config, and the inputs it refuses."""

from __future__ import annotations

import pytest
import torch

from kernels.gemm_decode import GemmDecodeConfig, block_m_for, linear_decode, pick_config
from tests.kernels.helpers import DEVICE, DTYPES, ON_GPU, TOLERANCE, generator, randn, rel_err

# Small tiles so the CPU cases cross several column tiles and K steps.
SMALL = GemmDecodeConfig(block_n=32, block_k=32, split_k=1, num_warps=4, num_stages=3)


def _case(m: int, n: int, k: int, dtype: torch.dtype, seed: int
          ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    gen = generator(seed)
    x = randn(m, k, dtype=dtype, gen=gen)
    w = randn(n, k, dtype=dtype, gen=gen, std=k ** -0.5)
    ref = x.cpu().double() @ w.cpu().double().T
    return x, w, ref


def _check(y: torch.Tensor, ref: torch.Tensor, dtype: torch.dtype) -> None:
    assert y.dtype == dtype and y.shape == ref.shape
    err = rel_err(y.cpu(), ref)
    assert err < TOLERANCE[dtype], f"rel err {err:.2e}"


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("m", [1, 5, 16, 33])
@pytest.mark.parametrize(("n", "k"), [(48, 64), (200, 320)])
@pytest.mark.parametrize("split_k", [1, 3])
def test_matches_float64(dtype: torch.dtype, m: int, n: int, k: int, split_k: int) -> None:
    x, w, ref = _case(m, n, k, dtype, seed=m * 1000 + n + k + split_k)
    config = GemmDecodeConfig(block_n=32, block_k=32, split_k=split_k, num_stages=3)
    # The second call finds the counters the first left behind: all back at 0.
    for _ in range(2):
        _check(linear_decode(x, w, config=config), ref, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("split_k", [2, 4, 7])
def test_split_k_partial_tiles_and_steps(dtype: torch.dtype, split_k: int) -> None:
    """N = 200 over 64-wide tiles, K = 200 over 64-wide steps (4 steps, so split 7 leaves some
    splits with no K at all), into a preallocated out with padded rows."""
    x, w, ref = _case(7, 200, 200, dtype, seed=split_k)
    config = GemmDecodeConfig(block_n=64, block_k=64, split_k=split_k, num_stages=2)
    storage = torch.full((7, 256), float("nan"), dtype=dtype, device=DEVICE)
    out = storage[:, :200]
    for _ in range(3):
        got = linear_decode(x, w, out, config=config)
        assert got.data_ptr() == out.data_ptr()
        _check(out, ref, dtype)
    assert torch.isnan(storage[:, 200:]).all(), "wrote past N"


@pytest.mark.parametrize("dtype", DTYPES)
def test_strided_x_rows(dtype: torch.dtype) -> None:
    x, w, ref = _case(9, 48, 96, dtype, seed=5)
    wide = torch.zeros(9, 160, dtype=dtype, device=DEVICE)
    wide[:, 32:128] = x
    _check(linear_decode(wide[:, 32:128], w, config=SMALL), ref, dtype)


@pytest.mark.parametrize("m", [1, 64])
def test_default_config(m: int) -> None:
    x, w, ref = _case(m, 96, 256, torch.float16, seed=m)
    _check(linear_decode(x, w), ref, torch.float16)


def test_pick_config_fills_waves() -> None:
    """Llama-2-7B projections at batch 64 on 132 multiprocessors: a few hundred programs at
    most, split_k only where the column tiles alone leave the chip under-filled."""
    for n, k in [(12288, 4096), (4096, 4096), (22016, 4096), (4096, 11008)]:
        c = pick_config(64, n, k, 132)
        programs = -(-n // c.block_n) * c.split_k
        assert 100 <= programs <= 2 * 132 or c.split_k == 1, (n, k, c)
        stage_bytes = (c.block_n + block_m_for(64)) * c.block_k * 2
        assert c.num_stages * stage_bytes <= 192 * 1024, c
    assert pick_config(64, 4096, 4096, 132).split_k > 1
    assert pick_config(64, 12288, 4096, 132).block_n == 128  # one wave of 128-wide tiles
    assert pick_config(64, 22016, 4096, 132).block_n == 64


def test_block_m() -> None:
    assert [block_m_for(m) for m in (1, 16, 17, 64, 65, 256)] == [16, 16, 32, 64, 128, 256]


def test_bad_inputs_raise() -> None:
    dtype = torch.float32
    x = torch.zeros(4, 64, dtype=dtype, device=DEVICE)
    w = torch.zeros(32, 64, dtype=dtype, device=DEVICE)
    cases = [
        (torch.zeros(257, 64, dtype=dtype, device=DEVICE), w, None, "at most 256"),
        (x, torch.zeros(32, 48, dtype=dtype, device=DEVICE), None, "K differs"),
        (x, torch.zeros(64, 32, dtype=dtype, device=DEVICE).T, None, "contiguous"),
        (x, w.to(torch.float16), None, "share one of"),
        (x.to(torch.int32), w.to(torch.int32), None, "share one of"),
        (x[0], w, None, "2-D"),
        (torch.zeros(64, 4, dtype=dtype, device=DEVICE).T, w, None, "last dimension"),
        (x, w, torch.zeros(4, 31, dtype=dtype, device=DEVICE), "out must be"),
        (x, w, torch.zeros(4, 32, dtype=torch.float16, device=DEVICE), "out must be"),
        (x, w, torch.zeros(32, 4, dtype=dtype, device=DEVICE).T, "last dimension"),
    ]
    for xi, wi, out, match in cases:
        with pytest.raises(ValueError, match=match):
            linear_decode(xi, wi, out, config=SMALL)
    for bad in [dict(block_n=24), dict(block_k=8), dict(split_k=0), dict(num_warps=3)]:
        with pytest.raises(ValueError):
            GemmDecodeConfig(**bad)  # type: ignore[arg-type]


@pytest.mark.skipif(ON_GPU, reason="the CPU device check applies off the interpreter only")
def test_cpu_without_interpreter_raises(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    x = torch.zeros(4, 64)
    with pytest.raises(ValueError, match="CUDA"):
        linear_decode(x, torch.zeros(32, 64), config=SMALL)


@pytest.mark.skipif(not ON_GPU, reason="needs the GPU (TRITON_INTERPRET=0)")
@pytest.mark.parametrize("m", [16, 64, 128, 256])
@pytest.mark.parametrize(("n", "k"), [(4096, 4096), (4096, 11008), (12288, 4096)])
def test_full_size_and_graph_replay(m: int, n: int, k: int) -> None:
    """Llama-2-7B shapes with the default config, then replayed in a CUDA graph on new inputs
    written in place (the counters reset within the launch, no host work)."""
    x, w, ref = _case(m, n, k, torch.float16, seed=m + n)
    y = linear_decode(x, w)
    _check(y, ref, torch.float16)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        linear_decode(x, w, y)
    for seed in (1, 2):
        x2, _, _ = _case(m, 1, k, torch.float16, seed=seed)
        x.copy_(x2)
        y.zero_()
        graph.replay()
        torch.cuda.synchronize()
        _check(y, x.cpu().double() @ w.cpu().double().T, torch.float16)
