"""The tile LoRA kernels compiled ahead of time for sm_90 (the H100/H200) on this CPU, with
Triton's bundled ptxas: what the interpreter cannot catch (a global a kernel may not read, a
type the compiler refuses) fails here, before a GPU run does. Both are compiled as decode
graphs launch them (PDL, rows gathered or not) at the engine's
largest rank tile, in a child process (the kernels are compiled only when imported with
TRITON_INTERPRET=0)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
CHILD = """
import json, re, sys
from bench.kernel_compile_cost import compile_cost
from slora_kernels import lora_expand, lora_shrink
common = {"MAX_RANK": 64, "DOT_PRECISION": "tf32", "BLOCK_M": 16, "BLOCK_R": 64,
          "RANK_BUCKETS": True, "GATHER_ROWS": sys.argv[2] == "1"}
if sys.argv[1] == "shrink":
    out = compile_cost(lora_shrink._lora_shrink_kernel,
                       {**common, "BLOCK_K": 256, "LAUNCH_DEPENDENTS": True}, 4)
else:
    out = compile_cost(lora_expand._lora_expand_kernel,
                       {**common, "BLOCK_N": 256, "EARLY_LOADS": True, "USE_PDL": True}, 4)
ptx = out["ptx"]
print(json.dumps({"mma": sorted(set(re.findall(r"mma[.][a-z0-9_.]+", ptx))),
                  "pdl_wait": "griddepcontrol.wait" in ptx,
                  "pdl_launch": "griddepcontrol.launch_dependents" in ptx}))
"""


def _compile(kernel: str, gather_rows: bool) -> dict[str, object]:
    env = {**os.environ, "TRITON_INTERPRET": "0", "PYTHONPATH": str(ROOT)}
    done = subprocess.run([sys.executable, "-c", CHILD, kernel, str(int(gather_rows))], env=env,
                          cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("gather_rows", [False, True])
def test_shrink_compiles_for_sm90(gather_rows: bool) -> None:
    assert _compile("shrink", gather_rows)["pdl_launch"]


@pytest.mark.parametrize("gather_rows", [False, True])
def test_expand_compiles_for_sm90(gather_rows: bool) -> None:
    """The expand's dot is tf32 on the float32 sums and B widened to float32 (m16n8k8)."""
    out = _compile("expand", gather_rows)
    assert out["pdl_wait"]
    kinds = " ".join(out["mma"])  # type: ignore[arg-type]
    assert "tf32" in kinds and "f32.f16.f16.f32" not in kinds, kinds
