"""The tensor-parallel suite in its CPU smoke form (`python -m bench tensor-parallel-smoke`: gloo,
float32, tiny shapes; about 50 s on a busy 2-core host): every part runs and writes its JSON,
TP=2 gives TP=1's tokens, and both give transformers + peft's greedy tokens."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_tensor_parallel_suite_smoke(tmp_path: Path) -> None:
    env = {**os.environ, "SLORA_COMMIT": "test"}
    res = subprocess.run([sys.executable, "-m", "bench", "tensor-parallel-smoke", "--out",
                          str(tmp_path)], cwd=ROOT, env=env, capture_output=True, text=True,
                         timeout=400)
    logs = "".join((tmp_path / f"tp-{p}.log").read_text()[-3000:] for p in ("7b", "70b"))
    assert res.returncode == 0, res.stdout + res.stderr + logs
    run = json.loads((tmp_path / "run.json").read_text())
    assert {s["step"]: s["rc"] for s in run["steps"]} == {"tp-7b": 0, "tp-70b": 0}, logs
    assert run["commit"] == "test"
    check = json.loads((tmp_path / "tp-correctness-smoke.json").read_text())
    assert check["commit"] == "test"
    same = check["tp2_vs_tp1_eager"]
    assert same["requests_with_equal_tokens"] == same["requests"] > 0
    for engine in ("tp1_eager", "tp2"):
        assert check["vs_hf_same_dtype"][engine]["greedy_agreement"] == 1.0
        assert check["vs_hf_same_dtype"][engine]["max_logits_rel_err"] < 1e-4
        fp32 = check["vs_hf_fp32"][engine]  # float32 runs: the yardstick's both sides agree
        assert fp32["greedy_agreement_with_hf_fp32"] == 1.0 and fp32["positions"] > 0
        assert fp32["agreement"]["faithful"]
    speed = json.loads((tmp_path / "tp-throughput-smoke.json").read_text())
    assert set(speed["runs"]) == {"tp1_eager", "tp2"}
    assert speed["runs"]["tp2"]["step_send_host_s"]["p50"] > 0
    big = json.loads((tmp_path / "tp-70b-smoke.json").read_text())
    assert big["run"]["requests"] == big["workload"]["num_requests"]
    assert big["run"]["adapter_loads"] > 0
