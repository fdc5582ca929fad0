"""The tile LoRA kernels compiled ahead of time for sm_90 (the H100/H200) on this CPU, with
Triton's bundled ptxas: what the interpreter cannot catch (a global a kernel may not read, a
type the compiler refuses) fails here, before a GPU run does. Both are compiled as decode
graphs launch them (PDL, rows gathered or not) at the engine's
largest rank tile, with the sole-adapter ride's expands beside them, in one child process (the
kernels are compiled only when imported with TRITON_INTERPRET=0)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
# One child compiles every case (it imports torch and Triton once, not once a case); a line of
# JSON per case.
CHILD = """
import json, re, sys
from bench.kernel_compile_cost import compile_cost
from slora_kernels import lora_expand, lora_shrink, ride_expand, rotary, silu_mul
# The sole-adapter ride's expands as the engine launches them (plainly, no griddepcontrol),
# rank bound 64, fp16, with BLOCK_M 16 for decode steps and 64 for prefill chunks
# (lora_meta.ride_blocks).
ride = {"DOT_PRECISION": "tf32", "BLOCK_M": 16}
RIDE = {
    "silu_mul_expand": (silu_mul._silu_mul_expand_kernel,
                        {**ride, "BLOCK_R": 64, "BLOCK_N": 64}),
    "silu_mul_expand_m64": (silu_mul._silu_mul_expand_kernel,
                            {**ride, "BLOCK_R": 64, "BLOCK_N": 64, "BLOCK_M": 64}),
    "rotary_expand": (rotary._rotary_expand_kernel, {**ride, "BLOCK_R": 64, "HALF": 64}),
    "rotary_expand_m64": (rotary._rotary_expand_kernel,
                          {**ride, "BLOCK_R": 64, "HALF": 64, "BLOCK_M": 64}),
    "expand_add": (ride_expand._expand_add_kernel, {**ride, "BLOCK_N": 128, "BLOCK_K": 64}),
}
for case in sys.argv[1:]:
    if case in RIDE:
        out = compile_cost(*RIDE[case], 4)
    else:
        kernel, gather = case.split(":")
        common = {"MAX_RANK": 64, "DOT_PRECISION": "tf32", "BLOCK_M": 16, "BLOCK_R": 64,
                  "RANK_BUCKETS": True, "GATHER_ROWS": gather == "1"}
        if kernel == "shrink":
            out = compile_cost(lora_shrink._lora_shrink_kernel,
                               {**common, "BLOCK_K": 256, "LAUNCH_DEPENDENTS": True}, 4)
        else:  # expand: one column tile a program; expand_cols: four of 128 columns
            cols = {"BLOCK_N": 128, "COLS": 4} if kernel == "expand_cols" else {
                "BLOCK_N": 256, "COLS": 1}
            out = compile_cost(lora_expand._lora_expand_kernel,
                               {**common, **cols, "EARLY_LOADS": True, "USE_PDL": True}, 4)
    ptx = out["ptx"]
    print(json.dumps({"case": case, "mma": sorted(set(re.findall(r"mma[.][a-z0-9_.]+", ptx))),
                      "pdl_wait": "griddepcontrol.wait" in ptx,
                      "pdl_launch": "griddepcontrol.launch_dependents" in ptx,
                      "cp_async": "cp.async" in ptx}))
"""
RIDE_CASES = ["silu_mul_expand", "silu_mul_expand_m64", "rotary_expand", "rotary_expand_m64",
              "expand_add"]
CASES = [f"{kernel}:{gather}" for kernel in ("shrink", "expand", "expand_cols")
         for gather in (0, 1)] \
    + RIDE_CASES


@pytest.fixture(scope="module")
def compiled() -> dict[str, dict[str, object]]:
    """Each case's PTX facts, by "kernel:gather_rows" (0 or 1) or ride kernel name."""
    env = {**os.environ, "TRITON_INTERPRET": "0", "PYTHONPATH": str(ROOT)}
    done = subprocess.run([sys.executable, "-c", CHILD, *CASES], env=env, cwd=ROOT,
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    lines = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
    by_case = {str(out.pop("case")): out for out in lines}
    assert sorted(by_case) == sorted(CASES), done.stdout[-3000:]
    return by_case


@pytest.mark.parametrize("gather_rows", [False, True])
def test_shrink_compiles_for_sm90(compiled: dict[str, dict[str, object]],
                                  gather_rows: bool) -> None:
    assert compiled[f"shrink:{int(gather_rows)}"]["pdl_launch"]


@pytest.mark.parametrize("kernel", ["expand", "expand_cols"])
@pytest.mark.parametrize("gather_rows", [False, True])
def test_expand_compiles_for_sm90(compiled: dict[str, dict[str, object]], kernel: str,
                                  gather_rows: bool) -> None:
    """The expand's dot is tf32 on the float32 sums and B widened to float32 (m16n8k8), one
    column tile a program or several (LoraTiles.expand_cols), whose loop the compiler
    pipelines (asynchronous copies; one tile a program has no loop to pipeline)."""
    out = compiled[f"{kernel}:{int(gather_rows)}"]
    assert out["cp_async"] == (kernel == "expand_cols")
    assert out["pdl_wait"]
    kinds = " ".join(out["mma"])  # type: ignore[arg-type]
    assert "tf32" in kinds and "f32.f16.f16.f32" not in kinds, kinds


@pytest.mark.parametrize("case", RIDE_CASES)
def test_ride_expands_compile_for_sm90(compiled: dict[str, dict[str, object]],
                                       case: str) -> None:
    """silu_mul's and rotary's fused expands and the Triton expand for o and down: 16-bit
    tensor-core dots, launched plainly (no wait for the GEMM before them)."""
    out = compiled[case]
    assert not out["pdl_wait"]
    assert any("f16.f16" in kind for kind in out["mma"]), out["mma"]  # type: ignore[attr-defined]
