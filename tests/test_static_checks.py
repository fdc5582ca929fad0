"""Static checks in the normal suite: ruff over the tree, mypy over the engine, the kernels, the
benchmarks, devtools and the services in one run (STYLE 10). Each runs the tool the repo pins in its test extras."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def run(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=600)


def test_ruff_is_clean():
    res = run("ruff", "check", ".")
    assert res.returncode == 0, res.stdout + res.stderr


def test_mypy_on_the_engine_kernels_benchmarks_and_services():
    # One mypy process: the two halves each read torch's stubs again, ~60 s of a cold cache.
    # Without the generated stubs every slora.v1 message would be Any and the check vacuous.
    stubs = sorted((ROOT / "slora" / "v1").glob("*_pb2.pyi"))
    assert stubs, "no slora/v1/*_pb2.pyi: run `python -m services.codegen` first"
    res = run("mypy", "slora_core", "slora_kernels", "bench", "devtools", "services",
              "--ignore-missing-imports", "--cache-dir", str(ROOT / ".mypy_cache"))
    assert res.returncode == 0, res.stdout + res.stderr
