"""The GPU checks' smoke path on the CPU at toy sizes: both parts of bench.gpu_checks (the
`gpu-tests` and `model-agreement` suites of `python -m bench`) run end to end (pytest shards,
bench.gpu_numerics, one bench.gpu_suite shape) and every JSON the H200 run commits is written,
with the commit it was given: each part leaves its summary and one tarball of everything else
(the device returns a limited number of files)."""

from __future__ import annotations

import ast
import json
import os
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def gpu_only_functions(source: str) -> set[str]:
    """The test functions in `source` skipped with a reason naming the GPU or CUDA."""
    found = set()
    for node in ast.walk(ast.parse(source)):
        if not isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            continue
        for deco in node.decorator_list:
            if isinstance(deco, ast.Call) and ast.unparse(deco.func).endswith("mark.skipif"):
                reason = " ".join(str(k.value.value) for k in deco.keywords
                                  if k.arg == "reason" and isinstance(k.value, ast.Constant))
                if "GPU" in reason or "CUDA" in reason:
                    found.add(node.name)
    return found


def test_the_gpu_part_runs_every_test_a_cpu_skips_for_want_of_a_gpu() -> None:
    """bench.gpu_checks A's default paths hold every GPU-only test function (as its directory,
    its file or its node), and every file with cases for a CUDA device whole."""
    from bench.gpu_checks import PYTEST_PATHS

    def covered(file: str, func: str | None) -> bool:
        return any(file == p or file.startswith(p.rstrip("/") + "/")
                   or (func is not None and p == f"{file}::{func}") for p in PYTEST_PATHS)

    missing = []
    for path in sorted((ROOT / "tests").rglob("test_*.py")):
        file, source = str(path.relative_to(ROOT)), path.read_text()
        funcs = gpu_only_functions(source)
        missing += [f"{file}::{f}" for f in sorted(funcs) if not covered(file, f)]
        if (not funcs and "cuda.is_available()" in source and path != Path(__file__)
                and not covered(file, None)):
            missing.append(file)  # cases parametrized on a CUDA device where there is one
    assert gpu_only_functions(
        "@pytest.mark.skipif(True, reason='needs a CUDA GPU')\ndef test_a(): pass\n"
        "@pytest.mark.skipif(True, reason='needs docker')\ndef test_b(): pass\n") == {"test_a"}
    assert not missing, f"GPU-only tests bench.gpu_checks A would not run: {missing}"


@pytest.mark.slow  # ~30 s: four processes at toy sizes
def test_both_parts_write_their_json_on_the_cpu(tmp_path: Path) -> None:
    import torch

    from bench.__main__ import card

    env = os.environ | {"SLORA_COMMIT": "smoke-commit", "OMP_NUM_THREADS": "1"}
    argv = [sys.executable, "-m", "bench.gpu_checks", "A", "B", "--out", str(tmp_path),
            "--device-args", "--device cpu --tiny", "--shards", "1",
            "--pytest-paths", "tests/slora_core/test_nonfinite_guard.py",
            "--numerics-dtypes", "float16", "--numerics-modes", "eager", "--shapes", "tiny-gqa"]
    res = subprocess.run(argv, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    tag = card([torch.cuda.get_device_name()]) if torch.cuda.is_available() else "cpu"
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        f"gpu-part-A-{tag}.json", "gpu-part-A.tgz", f"gpu-part-B-{tag}.json", "gpu-part-B.tgz"]
    for part, names in (("A", {f"gpu-numerics-float16-eager-{tag}.json",
                               "gpu-numerics-float16-eager.log",
                               f"gpu-numerics-float16-guard-{tag}.json",
                               "gpu-numerics-float16-guard.log",
                               "gpu-pytest-0.xml", "gpu-pytest-0.log"}),
                        ("B", {f"gpu-suite-tiny-gqa-{tag}.json", "gpu-suite-tiny-gqa.log"})):
        with tarfile.open(tmp_path / f"gpu-part-{part}.tgz") as tar:
            assert set(tar.getnames()) == names | {f"gpu-part-{part}-{tag}.json"}
            tar.extractall(tmp_path, filter="data")
    part_a = json.loads((tmp_path / f"gpu-part-A-{tag}.json").read_text())
    assert part_a["ok"] and part_a["commit"] == "smoke-commit"
    assert part_a["pytest"]["passed"] > 0 and not part_a["pytest"]["failed"]
    assert set(part_a["processes"]) == {"numerics-float16-eager", "numerics-float16-guard",
                                        "pytest-0"}
    numerics = json.loads((tmp_path / f"gpu-numerics-float16-eager-{tag}.json").read_text())
    assert numerics["ok"] and numerics["tokens_from_nonfinite_rows_total"] == 0
    assert numerics["commit"] == "smoke-commit" and numerics["pieces"] == ["modes", "ops"]
    assert set(numerics["strengths"][0]["dtypes"]["float16"]) == {"eager", "ops"}
    # The guard in a process of its own: it alone ran there, and held.
    guard = json.loads((tmp_path / f"gpu-numerics-float16-guard-{tag}.json").read_text())
    assert guard["ok"] and guard["guard_ok"] and guard["pieces"] == ["guard"]
    assert set(guard["strengths"][0]["dtypes"]["float16"]) == {"guard"}
    part_b = json.loads((tmp_path / f"gpu-part-B-{tag}.json").read_text())
    assert part_b["ok"] and set(part_b["processes"]) == {"suite-tiny-gqa"}
    suite = json.loads((tmp_path / f"gpu-suite-tiny-gqa-{tag}.json").read_text())
    eager = suite["shapes"][0]["modes"]["eager"]
    assert eager["churn_counts_positive"] and eager["logits_within_tolerance"]
    # The arena was sized by simulating the scheduler: the engine met the counts planned.
    planned = suite["shapes"][0]["arena"]["planned"]
    assert planned == {k: eager["stats"][k] for k in planned}
    # The sole-adapter merge mode ran steps merged and agreed with HF + peft.
    merge = suite["shapes"][0]["modes"]["merge_sole_adapter"]
    assert merge["ok"] and merge["stats"]["merges"] >= 1 and merge["stats"]["merged_steps"] > 0
    # The sole-adapter ride mode (the merge off) rode steps and agreed with HF + peft.
    ride = suite["shapes"][0]["modes"]["ride_sole_adapter"]
    assert ride["ok"] and ride["stats"]["ride_steps"] > 0 and "merges" not in ride["stats"]
