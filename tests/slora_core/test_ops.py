"""slora_core.ops: CPU tensors take the torch references without importing Triton; CUDA
tensors take the Triton kernels (checked on a GPU machine)."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from slora_core import ops
from slora_kernels.attention_reference import paged_attention_reference
from slora_kernels.lora_meta import LoraMeta
from slora_kernels.lora_reference import add_lora_reference


def test_cpu_processes_never_import_triton() -> None:
    code = (
        "import sys, torch\n"
        "from slora_core import ops\n"
        "from slora_kernels.lora_meta import LoraMeta\n"
        "y = torch.zeros(1, 4); x = torch.ones(1, 4); t = torch.zeros(1, 7, dtype=torch.int64)\n"
        "ops.add_lora(y, x, torch.zeros(8), t, t, t.int(), t.float(), (0,), ((0, 4),),\n"
        "             LoraMeta.from_token_slots([0]))\n"
        "assert 'triton' not in sys.modules, 'triton imported on the CPU path'\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def _lora_inputs(device: str) -> tuple:
    gen = torch.Generator().manual_seed(0)
    k, n, r = 64, 48, 8
    arena = torch.randn(r * k + n * r + 10, generator=gen).to(device, torch.float16)
    tables = torch.zeros(2, 7, dtype=torch.int64)
    b_off = tables.clone()
    b_off[1, 3] = r * k + 10
    ranks = torch.zeros(2, 7, dtype=torch.int32)
    ranks[1, 3] = r
    scales = torch.full((2, 7), 0.5)
    x = torch.randn(3, k, generator=gen).to(device, torch.float16)
    y = torch.randn(3, n, generator=gen).to(device, torch.float16)
    meta = LoraMeta.from_token_slots([1, -1, 1], device=device)
    return (y, x, arena, tables.to(device), b_off.to(device), ranks.to(device),
            scales.to(device), (3,), ((0, n),), meta)


def test_add_lora_on_cpu_is_the_reference() -> None:
    args = _lora_inputs("cpu")
    y_ref = args[0].clone()
    ops.add_lora(*args)
    add_lora_reference(y_ref, *args[1:])
    assert torch.equal(args[0], y_ref)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_tensors_take_the_triton_kernels() -> None:
    args = _lora_inputs("cuda")
    y_ref = args[0].double().cpu()
    ops.add_lora(*args, max_rank=8)
    cpu = [a.cpu() if isinstance(a, torch.Tensor) else a for a in args[1:9]]
    add_lora_reference(y_ref, cpu[0].double(), cpu[1].double(), *cpu[2:],
                       LoraMeta.from_token_slots([1, -1, 1]))
    assert torch.allclose(args[0].cpu().double(), y_ref, atol=2e-2)
    assert "slora_kernels.lora" in sys.modules

    q = torch.randn(2, 4, 32, device="cuda", dtype=torch.float16)
    k_cache = torch.randn(3, 8, 2, 32, device="cuda", dtype=torch.float16)
    v_cache = torch.randn_like(k_cache)
    tables = torch.tensor([[2, 0], [1, 0]], dtype=torch.int32, device="cuda")
    lens = torch.tensor([11, 5], dtype=torch.int32, device="cuda")
    starts = torch.tensor([0, 1, 2], dtype=torch.int32, device="cuda")
    ref = paged_attention_reference(q.double(), k_cache.double(), v_cache.double(), tables,
                                    lens, starts, 0.2)
    for mql in (None, 1):
        out = ops.paged_attention(q, k_cache, v_cache, tables, lens, starts, 0.2,
                                  max_query_len=mql)
        assert torch.allclose(out.double(), ref, atol=5e-3)


DEVICES = ["cpu", *(["cuda"] if torch.cuda.is_available() else [])]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_linear_float32_keeps_the_float32_accumulator(device: str, dtype: torch.dtype) -> None:
    """The LM head's logits: float32 out of 16-bit inputs, within float32 accumulation of the
    float64 product; the 16-bit output of the same GEMM carries its own rounding, orders of
    magnitude more (fp16 ~2^-12 relative, bf16 ~2^-9)."""
    gen = torch.Generator().manual_seed(3)
    x = (torch.randn(5, 256, generator=gen) * 3).to(device, dtype)
    w = (torch.randn(1000, 256, generator=gen) / 16).to(device, dtype)
    ref = x.double() @ w.double().T
    got = ops.linear_float32(x, w)
    assert got.dtype == torch.float32 and got.shape == (5, 1000)
    err = float((got.double() - ref).norm() / ref.norm())
    rounded = torch.nn.functional.linear(x, w).double()
    err16 = float((rounded - ref).norm() / ref.norm())
    assert err < 1e-5, err
    assert err16 > 10 * err, (err16, err)
