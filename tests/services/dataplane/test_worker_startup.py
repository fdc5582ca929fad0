"""A worker's start-up: `slora worker --warm-cache-only` fills the compiled-kernel cache of its
cache directory and exits; a worker started on that directory finds the cache warm, counts the
start in its manifest, and exports its start-up profile as metrics."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from services.common.processes import free_port, slora_argv, start_child, wait_serving
from services.worker.startup import COMPILED_SUBDIR
from tests.services.dataplane.dp_support import generate, request, scrape

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]


def manifests(cache: Path) -> list[dict[str, object]]:
    return [json.loads(p.read_text()) for p in (cache / COMPILED_SUBDIR).glob("*/manifest.json")]


def test_warm_cache_only_then_a_worker_on_the_warm_cache(demo_dir: Path, tmp_path: Path) -> None:
    cache = tmp_path / "cache"
    model = str(demo_dir / "model")
    filled = subprocess.run(slora_argv("worker", "--model", model, "--cache-dir", str(cache),
                                       "--warm-cache-only", "--max-num-seqs", "2"),
                            capture_output=True, text=True, timeout=240)
    assert filled.returncode == 0, filled.stderr[-3000:]
    assert "start-up profile" in filled.stderr and "(cpu): cold" in filled.stderr
    [first] = manifests(cache)
    assert first["starts"] == 1 and first["key"]["device"] == "cpu"  # type: ignore[index]

    address, metrics = f"127.0.0.1:{free_port()}", free_port()
    worker = start_child("worker", slora_argv(
        "worker", "--model", model, "--control-plane", f"127.0.0.1:{free_port()}",
        "--listen", address, "--worker-id", "startup", "--metrics-port", str(metrics),
        "--cache-dir", str(cache), "--max-num-seqs", "2"), tmp_path)
    try:
        wait_serving(address, worker, timeout_s=180)
        # Serving means served: the first call answers at once.
        assert generate(address, request(max_new_tokens=2)).error is None
        m = scrape(metrics)
        phases = {k.split('"')[1]: v for k, v in m.items()
                  if k.startswith("slora_worker_startup_seconds{")}
        assert {"process", "core_spawn", "weights", "arena", "warmup", "server",
                "ready"} <= set(phases), phases
        assert "graph_capture" not in phases  # no graphs on a CPU
        assert phases["ready"] >= phases["weights"] + phases["arena"] + phases["warmup"] > 0
        assert m['slora_worker_startup_kernels{result="compiled"}'] == 0
        log = worker.log_tail(20000)
        assert "(cpu): warm" in log and "ready " in log and "start-up profile" in log
    finally:
        worker.stop()
    [second] = manifests(cache)  # the same key: the same folder, one more start
    assert second["digest"] == first["digest"] and second["starts"] == 2
