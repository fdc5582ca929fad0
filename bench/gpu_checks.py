"""Every GPU claim re-verified on the commit under test (`python -m bench gpu-tests` /
`model-agreement` run the two parts; this module is what they call):

  A  the GPU-only pytest tests (the ones a CPU skips: full-size kernels, CUDA model and ops, the
     compiled-variant count) and the rest of tests/kernel_tests compiled (TRITON_INTERPRET=0), split
     over --shards pytest processes, beside bench.gpu_numerics (massive activations, fp16/bf16
     vs HF, the non-finite guard; one process per dtype, or per dtype and mode). Triton
     compiles each kernel variant in the calling process, one at a time; one process ran 114 of
     the ~150 tests in 250 s.
  B  bench.gpu_suite, one process per shape (Llama-2-7B, Llama-3-8B widths) side by side.

Every process writes its JSON as it goes (a process stopped at --limit-s keeps what it finished;
the scripts also skip, and record, a mode that would not end before the limit). Each part then
writes OUT/gpu-part-<A|B>-<card>.json (named for the card: h100, h200, ..., cpu): commit,
command, hardware, limits, each process's exit status and seconds, the pytest counts, failures
and slowest tests, and the verdicts of the scripts' JSONs; and OUT/gpu-part-<A|B>.tgz holding
everything the part wrote (the device returns a limited number of files; the loose copies are
removed).

CPU smoke run (toy sizes; kernel tests in the Triton interpreter):
    TRITON_INTERPRET=1 python -m bench.gpu_checks A B --out /tmp/out --shards 2 \\
        --device-args "--device cpu --tiny" --shapes tiny-mha tiny-gqa \\
        --pytest-paths tests/kernel_tests/test_fused.py tests/slora_core/test_ops.py
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import shlex
import signal
import subprocess
import sys
import tarfile
import threading
import time
import xml.etree.ElementTree as ET
from pathlib import Path
from typing import Any

import pytest

from bench.__main__ import card
from bench.run_record import commit_id

# Every test a CPU skips for want of a GPU is here, as its file or its node
# (tests/bench/test_gpu_suite_smoke.py checks that none is missing).
PYTEST_PATHS = ["tests/kernel_tests", "tests/slora_core/test_ops.py", "tests/slora_core/test_model.py",
                "tests/slora_core/test_nonfinite_guard.py", "tests/slora_core/test_host_copy.py",
                "tests/slora_core/test_graph_capture.py", "tests/slora_core/test_lora_merge.py",
                "tests/slora_core/test_precompile.py", "tests/slora_core/test_sampler_penalties.py",
                "tests/slora_core/test_prefix_cache.py::"
                "test_on_the_gpu_with_graphs_the_cache_gives_the_tokens_without_it",
                "tests/slora_core/test_admission.py::"
                "test_on_the_gpu_the_pacer_times_the_steps_and_changes_no_token",
                "tests/slora_core/test_admission.py::"
                "test_on_the_gpu_a_paced_step_after_an_overrun_reports_the_idle_gap",
                "tests/services/dataplane/test_worker_startup_graphs.py::"
                "test_graphs_captured_while_serving_on_the_gpu"]
SHAPES = ["llama2-7b", "llama3-8b"]
LIMIT_EXIT = (124, 130, 137, -2, -9, -15)  # stopped at the limit
EVERY_TEST = ("-m", "slow or not slow")  # the GPU run checks the slow set too


def plan_shards(paths: list[str], shards: int) -> list[list[str]]:
    """Split the collected tests over shards: one test function's cases stay together (they
    share compiled variants), the GPU-only cases (skipif with a GPU/CUDA reason) count three and
    run first in their shard, big functions are cut so the shards come out even."""
    items: list[Any] = []

    class Collect:
        def pytest_collection_modifyitems(self, items: list[Any]) -> None:
            collected.extend(items)

    collected = items  # the plugin's method names its own argument `items` (pytest's hook spec)
    pytest.main(["--collect-only", "-qq", "-p", "no:cacheprovider", *EVERY_TEST, *paths],
                plugins=[Collect()])

    def gpu_only(item: Any) -> bool:
        return any(w in str(m.kwargs.get("reason", "")) for m in item.iter_markers("skipif")
                   for w in ("GPU", "CUDA"))

    groups: dict[str, list[Any]] = {}
    for item in items:
        groups.setdefault(item.nodeid.split("[")[0], []).append(item)
    weight = {i.nodeid: 3 if gpu_only(i) else 1 for i in items}
    cap = max(3, sum(weight.values()) // shards)
    pieces: list[tuple[int, list[str]]] = []
    for members in groups.values():
        piece: list[str] = []
        w = 0
        for i in members:
            if piece and w + weight[i.nodeid] > cap:
                pieces.append((w, piece))
                piece, w = [], 0
            piece.append(i.nodeid)
            w += weight[i.nodeid]
        pieces.append((w, piece))
    load = [0] * shards
    plan: list[list[str]] = [[] for _ in range(shards)]
    for w, piece in sorted(pieces, key=lambda p: -p[0]):
        k = load.index(min(load))
        load[k] += w
        plan[k] += piece
    for ids in plan:
        ids.sort(key=lambda n: weight[n] != 3)
    print(f"{len(items)} tests, {sum(w == 3 for w in weight.values())} GPU-only, "
          f"shard weights {load}", flush=True)
    return [ids for ids in plan if ids]


def threads(processes: int) -> str:
    """OMP_NUM_THREADS for N processes side by side: the cores shared out. torch's default
    (every core per process) oversubscribes them, and its spinning threads then slow host-side
    ops many times over (one toy shape on a busy 2-core host: 1.8 s with one thread, 52-122 s
    with the default)."""
    return os.environ.get("OMP_NUM_THREADS") or str(max(1, (os.cpu_count() or 1) // processes))


def run_all(jobs: dict[str, list[str]], out: Path, limit_s: int, env: dict[str, str],
            stop: signal.Signals = signal.SIGINT) -> dict[str, dict[str, Any]]:
    """Each job (name -> argv) as its own process, all side by side, each under `limit_s`
    (`stop` first: pytest then still writes its XML; SIGKILL 20 s later); log in
    OUT/gpu-NAME.log."""
    status: dict[str, dict[str, Any]] = {}

    def one(name: str, argv: list[str]) -> None:
        t0 = time.monotonic()
        with open(out / f"gpu-{name}.log", "wb") as log:
            proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, env=env,
                                    start_new_session=True)
            try:
                rc = proc.wait(limit_s)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, stop)
                try:
                    proc.wait(20)
                except subprocess.TimeoutExpired:
                    os.killpg(proc.pid, signal.SIGKILL)
                    proc.wait()
                rc = 124
        status[name] = {"exit_status": rc, "seconds": int(time.monotonic() - t0),
                        "cut_by_limit": rc in LIMIT_EXIT}

    workers = [threading.Thread(target=one, args=item) for item in jobs.items()]
    for w in workers:
        w.start()
    for w in workers:
        w.join()
    return status


def pytest_counts(out: Path) -> dict[str, Any]:
    counts = {"tests": 0, "failures": 0, "errors": 0, "skipped": 0}
    failed: list[str] = []
    slowest: list[tuple[float, str]] = []
    for path in sorted(glob.glob(f"{out}/gpu-pytest-*.xml")):
        try:
            for suite in ET.parse(path).getroot().iter("testsuite"):
                for k in counts:
                    counts[k] += int(suite.get(k, 0))
                for case in suite.iter("testcase"):
                    name = case.get("classname", "") + "::" + case.get("name", "")
                    slowest.append((float(case.get("time", 0)), name))
                    if case.find("failure") is not None or case.find("error") is not None:
                        failed.append(name)
        except ET.ParseError as e:
            failed.append(f"{path}: unreadable ({e})")
    counts["passed"] = (counts["tests"] - counts["failures"] - counts["errors"]
                        - counts["skipped"])
    return counts | {"failed": failed, "slowest": [
        {"test": n, "seconds": round(t, 1)} for t, n in sorted(slowest, reverse=True)[:15]]}


def script_verdicts(paths: list[str]) -> dict[str, Any]:
    scripts: dict[str, Any] = {}
    keys = ("ok", "seconds", "skipped", "guard_ok", "faithful_ok",
            "tokens_from_nonfinite_rows_total")
    mode_keys = ("ok", "skipped", "agreement", "max_rel_err_vs_hf_fp32",
                 "max_hf_same_dtype_rel_err_vs_fp32", "greedy_agreement_with_hf_fp32",
                 "hf_same_dtype_agreement_with_hf_fp32", "stats")
    for path in paths:
        try:
            d = json.loads(Path(path).read_text())
        except (OSError, ValueError) as e:
            scripts[os.path.basename(path)] = {"unreadable": str(e)}
            continue
        summary = {k: d[k] for k in keys if k in d}
        for s in d.get("shapes", []):
            summary[s.get("shape", {}).get("name", "?")] = {
                m: {k: r[k] for k in mode_keys if k in r} for m, r in s.get("modes", {}).items()}
        scripts[os.path.basename(path)] = summary
    return scripts


def hardware() -> tuple[str, str]:
    import torch

    gpu = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
    return gpu, torch.__version__


def run_part(part: str, a: argparse.Namespace, out: Path) -> bool:
    start = time.monotonic()
    env = os.environ | {"PYTHONPATH": os.pathsep.join(filter(None, (
        os.getcwd(), os.environ.get("PYTHONPATH")))), "PYTHONUNBUFFERED": "1",
        "SLORA_COMMIT": commit_id()}
    budget = str(a.limit_s - 45)  # the scripts start no mode that would end past this
    py = sys.executable
    tag = card([hardware()[0]])  # files named for the card they ran on
    device_args = shlex.split(a.device_args)
    if part == "A":
        env.setdefault("TRITON_INTERPRET", "0")
        os.environ.setdefault("TRITON_INTERPRET", env["TRITON_INTERPRET"])
        for stale in glob.glob(f"{out}/gpu-pytest-*.xml"):
            os.remove(stale)
        jobs = {f"pytest-{k}": [py, "-m", "pytest", "-q", "-p", "no:cacheprovider", *EVERY_TEST,
                                "--durations=10", f"--junitxml={out}/gpu-pytest-{k}.xml", *ids]
                for k, ids in enumerate(plan_shards(a.pytest_paths, a.shards))}
        # One process per dtype, or per dtype and mode with --numerics-modes (the first mode's
        # beside the op-level comparison) and one for the guard: in one process the graph
        # modes' compiles outran the budget on 5 of 6 H100 runs; one process a dtype still
        # skipped the guard and all_graphs_async (all_graphs alone compiled 139 s); one a mode
        # ran each graph mode in ~215 s, which left the guard beside all_graphs no time
        # (gpu-part-A-c123b76-h100.json).
        numerics: dict[str, list[str]] = {}
        for k, mode in enumerate(a.numerics_modes):
            numerics[mode] = ["--modes", mode, "--pieces", "modes", *(["ops"] if k == 0 else [])]
        if a.numerics_modes:
            # in all_graphs on a GPU (bench.gpu_numerics.guard_mode; eager on a CPU)
            numerics["guard"] = ["--modes", "all_graphs", "--pieces", "guard"]
        for dt in a.numerics_dtypes:
            for part_name, part_args in (numerics or {"": []}).items():
                name = f"{dt}-{part_name}" if part_name else dt
                jobs[f"numerics-{name}"] = [
                    py, "-m", "bench.gpu_numerics", *device_args, *shlex.split(a.numerics_args),
                    "--dtypes", dt, *part_args,
                    "--budget-s", budget, "--out", str(out / f"gpu-numerics-{name}-{tag}.json")]
    else:
        jobs = {f"suite-{shape}": [py, "-m", "bench.gpu_suite", *device_args,
                                   *shlex.split(a.suite_args), "--shapes", shape,
                                   "--budget-s", budget,
                                   "--out", str(out / f"gpu-suite-{shape}-{tag}.json")]
                for shape in a.shapes}
    env["OMP_NUM_THREADS"] = threads(len(jobs))
    procs = run_all(jobs, out, a.limit_s, env)
    gpu, torch_version = hardware()
    report: dict[str, Any] = {
        "part": part, "commit": env["SLORA_COMMIT"],
        "command": "python -m bench.gpu_checks " + " ".join(sys.argv[1:]), "hardware": gpu,
        "torch": torch_version, "limit_s": a.limit_s,
        "seconds": int(time.monotonic() - start), "processes": procs}
    written = sorted(glob.glob(f"{out}/gpu-numerics-*-{tag}.json" if part == "A"
                               else f"{out}/gpu-suite-*-{tag}.json"))
    if part == "A":
        report["pytest"] = pytest_counts(out)
    report["results"] = script_verdicts(written)
    report["ok"] = (bool(procs) and all(p["exit_status"] == 0 for p in procs.values())
                    and all(s.get("ok") for s in report["results"].values()))
    summary = out / f"gpu-part-{part}-{tag}.json"
    summary.write_text(json.dumps(report, indent=1))
    print(json.dumps(report, indent=1), flush=True)
    files = [summary, *(out / f"gpu-{name}.log" for name in jobs), *map(Path, written)]
    if part == "A":
        files += map(Path, glob.glob(f"{out}/gpu-pytest-*.xml"))
    with tarfile.open(out / f"gpu-part-{part}.tgz", "w:gz") as tar:
        for f in files:
            if f.exists():
                tar.add(f, arcname=f.name)
    for f in files[1:]:
        f.unlink(missing_ok=True)
    return bool(report["ok"])


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("parts", nargs="+", choices=("A", "B"))
    p.add_argument("--out", default="bench/results")
    p.add_argument("--shards", type=int, default=8, help="pytest processes of part A")
    p.add_argument("--limit-s", type=int, default=450, help="each process's time limit")
    p.add_argument("--pytest-paths", nargs="+", default=PYTEST_PATHS)
    p.add_argument("--shapes", nargs="+", default=SHAPES, help="part B: one process each")
    p.add_argument("--device-args", default="", help="for both scripts, e.g. '--device cpu --tiny'")
    p.add_argument("--numerics-args", default="", help="for bench.gpu_numerics")
    p.add_argument("--numerics-dtypes", nargs="*", default=["float16", "bfloat16"],
                   help="part A: one bench.gpu_numerics process each (none: pytest alone)")
    p.add_argument("--numerics-modes", nargs="*", default=[],
                   help="part A: one process per dtype and mode (default: all modes in one)")
    p.add_argument("--suite-args", default="", help="for bench.gpu_suite")
    a = p.parse_args(argv)
    if a.numerics_modes:  # a bad name would fail only its own process, minutes later
        from bench.gpu_numerics import MODES

        unknown = sorted(set(a.numerics_modes) - set(MODES))
        if unknown:
            p.error(f"--numerics-modes: unknown {unknown}; choose from {sorted(MODES)}")
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    results = [run_part(part, a, out) for part in a.parts]
    return 0 if all(results) else 1


if __name__ == "__main__":
    sys.exit(main())
