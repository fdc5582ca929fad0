"""Worker start-up time: from `slora worker`'s process start to the first token it serves, with
an empty compiled-kernel cache (cold) and with the cache the cold start left (warm), side by
side in one run, for Llama-2-7B shapes in float16 and the tiny test model in float32, with each
start's profile (slora_worker_startup_seconds and friends, scraped from its metrics port).

    python -m bench.worker_startup --device cuda --out bench/results/worker-startup-h200.json
    python -m bench.worker_startup --smoke --out /tmp/worker-startup-cpu.json   # CPU, tiny only

Each start is a real worker process (no control plane: base-model calls need none) polled with
a one-token Generate until a token comes back. The 7B-shape model is written with random
weights (devtools.demo_assets, the demo tokenizer's 512-token vocabulary) once per run; its
files are dropped from the OS page cache before the cold start (a fresh node reads them from
disk) and left there for the warm one (a restart on the same node). Targets for the 7B shapes:
warm <= 30 s, cold <= 90 s.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import grpc
import torch

from bench.cold_load import drop_file_cache
from bench.run_record import run_record
from bench.serving import SHAPES
from devtools.demo_assets import write_demo_assets
from services.common.processes import Child, exit_on_sigterm, free_port, slora_argv, start_child
from slora.v1 import inference_pb2 as pb
from slora.v1 import inference_pb2_grpc as pb_grpc

TARGETS_S = {"llama2-7b": {"warm": 30.0, "cold": 90.0}}
DTYPES = {"tiny": "float32", "llama2-7b": "float16"}
POLL_S = 0.25
# Kept from each start's wait for stopping its worker (SIGTERM, drain, exit).
STOP_MARGIN_S = 20.0
# Kept for each start still to come (a tiny model's start, or a 7B warm one, fits).
RESERVE_S = 45.0


def write_model(root: Path, name: str, device: str) -> Path:
    """The model directory of `name` ("tiny": the test model; "llama2-7b": its shapes)."""
    overrides = None
    if name != "tiny":
        overrides = {k: v for k, v in SHAPES[name].items() if k != "vocab_size"}
    dtype = getattr(torch, DTYPES[name])
    assets = write_demo_assets(root / name, seed=0, model_overrides=overrides, adapters=(),
                               dtype=dtype, device=device if name != "tiny" else "cpu")
    return assets.model_dir


def first_token(address: str) -> bool | str:
    """One Generate of one token: True when a token came back, False when the worker does not
    serve yet (UNAVAILABLE), else what went wrong."""
    req = pb.GenerateRequest(token_ids=pb.TokenIds(ids=[3, 4, 5, 6]),
                             sampling=pb.SamplingOptions(max_new_tokens=1, temperature=0.0))
    with grpc.insecure_channel(address) as channel:
        try:
            for r in pb_grpc.InferenceServiceStub(channel).Generate(req, timeout=30):
                if r.HasField("chunk") and r.chunk.token_ids:
                    return True
        except grpc.RpcError as e:
            if e.code() == grpc.StatusCode.UNAVAILABLE:
                return False
            return f"{e.code().name}: {e.details()}"
    return "the stream ended without a token"


def scrape_startup(port: int) -> dict[str, Any]:
    """The worker's slora_worker_startup_* metrics as {phases, graphs, kernels, compile_s}."""
    import urllib.request

    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    out: dict[str, Any] = {"phases": {}, "graphs": {}, "kernels": {}, "compile_s": 0.0,
                           "graphs_pending": 0}
    for line in text.splitlines():
        if not line.startswith("slora_worker_startup"):
            continue
        name, value = line.rsplit(" ", 1)
        labels = dict(kv.split("=", 1) for kv in name[name.find("{") + 1:-1].split(",")
                      if "=" in kv) if "{" in name else {}
        labels = {k: v.strip('"') for k, v in labels.items()}
        if name.startswith("slora_worker_startup_seconds"):
            out["phases"][labels["phase"]] = round(float(value), 3)
        elif name.startswith("slora_worker_startup_graph_seconds"):
            out["graphs"][f"{labels['graphs']}/{labels['bucket']}"] = round(float(value), 3)
        elif name.startswith("slora_worker_startup_kernels"):
            out["kernels"][labels["result"]] = int(float(value))
        elif name.startswith("slora_worker_startup_kernel_compile_seconds"):
            out["compile_s"] = round(float(value), 3)
        elif name.startswith("slora_worker_startup_graphs_pending"):
            out["graphs_pending"] = int(float(value))
    return out


def start_once(model_dir: Path, dtype: str, args: argparse.Namespace, cache_dir: Path,
               log_dir: Path, name: str, timeout_s: float, background: bool) -> dict[str, Any]:
    """Start a worker, wait for its first token and then for its background graphs (at most
    `timeout_s` in all, the graphs at most --graphs-wait-s), read its profile, stop it.
    Seconds are from just before the process was started."""
    address, metrics = f"127.0.0.1:{free_port()}", free_port()
    argv = slora_argv("worker", "--model", str(model_dir), "--control-plane",
                      f"127.0.0.1:{free_port()}", "--listen", address, "--worker-id", name,
                      "--metrics-port", str(metrics), "--cache-dir", str(cache_dir),
                      "--device", args.device, "--dtype", dtype,
                      "--max-num-seqs", str(args.max_num_seqs),
                      "--num-pages", str(args.num_pages),
                      "--graphs-in-background" if background else "--graphs-before-ready")
    t0 = time.monotonic()
    child = start_child(name, argv, log_dir)
    try:
        return _wait_first_token(child, address, metrics, t0, timeout_s, args.graphs_wait_s)
    finally:
        child.stop(timeout_s=30)


def _wait_first_token(child: Child, address: str, metrics: int, t0: float,
                      timeout_s: float, graphs_wait_s: float) -> dict[str, Any]:
    while time.monotonic() - t0 < timeout_s:
        if not child.alive:
            return {"served": False, "exit_code": child.popen.returncode,
                    "log_tail": child.log_tail(3000)}
        got = first_token(address)
        if isinstance(got, str):
            return {"served": False, "error": got, "log_tail": child.log_tail(3000)}
        if got:
            took = time.monotonic() - t0
            row = {"served": True, "first_token_s": round(took, 3)}
            row |= _wait_graphs(metrics, t0, min(timeout_s, took + graphs_wait_s))
            return row
        time.sleep(POLL_S)
    return {"served": False, "timed_out_after_s": timeout_s, "log_tail": child.log_tail(3000)}


def _wait_graphs(metrics: int, t0: float, timeout_s: float) -> dict[str, Any]:
    """Once serving: wait for the graphs the worker captures in the background; the profile
    then, with `graphs_done_s` (from the start) or `graphs_pending` when time ran out."""
    while True:
        profile = scrape_startup(metrics)
        pending = profile.pop("graphs_pending")
        if not pending:
            return {"graphs_done_s": round(time.monotonic() - t0, 3), **profile}
        if time.monotonic() - t0 >= timeout_s:
            return {"graphs_pending": pending, **profile}
        time.sleep(POLL_S)


class Budget:
    """The run's time: each start gets at most --timeout-s, and never so much that the starts
    after it lose their RESERVE_S or the run passes its deadline."""

    def __init__(self, seconds: float, starts: int) -> None:
        self.deadline = time.monotonic() + seconds
        self.starts_left = starts

    def next_start(self, timeout_s: float) -> float:
        """Seconds the next start may take (<= 0: none left)."""
        self.starts_left -= 1
        left = (self.deadline - time.monotonic() - STOP_MARGIN_S
                - RESERVE_S * self.starts_left)
        return min(timeout_s, left)


def run_model(name: str, root: Path, args: argparse.Namespace, budget: Budget
              ) -> dict[str, Any]:
    """Write the model, then start a worker on it twice: cold, then warm, each within its
    share of the budget."""
    t0 = time.monotonic()
    model_dir = write_model(root, name, args.device)
    row: dict[str, Any] = {"dtype": DTYPES[name], "write_model_s": round(time.monotonic() - t0, 1)}
    cache = root / f"cache-{name}"
    shutil.rmtree(cache, ignore_errors=True)
    kinds = ("cold", "warm", *(("warm_background",) if args.also_background else ()))
    for kind in kinds:
        if kind == "cold" and not args.keep_page_cache:
            drop_file_cache(model_dir)
        left = budget.next_start(args.timeout_s)
        if left <= 0:
            row[kind] = {"served": False, "skipped": "the run's --budget-s was spent"}
            continue
        background = args.graphs_in_background or kind == "warm_background"
        row[kind] = start_once(model_dir, DTYPES[name], args, cache, root / "logs",
                               f"{name}-{kind}", left, background)
        row[kind]["graphs_in_background"] = background
        print(f"{name} {kind}: {summary(row[kind])}", flush=True)
    targets = TARGETS_S.get(name)
    if targets:
        row["targets_s"] = targets
        row["meets_targets"] = all(
            row[k].get("served") and row[k]["first_token_s"] <= t for k, t in targets.items())
    return row


def summary(r: dict[str, Any]) -> str:
    if not r.get("served"):
        return f"NOT SERVED {({k: v for k, v in r.items() if k != 'log_tail'})}"
    graphs = (f"all {len(r['graphs'])} graph buckets by {r['graphs_done_s']:.1f} s"
              if "graphs_done_s" in r else f"{r['graphs_pending']} graphs pending")
    return (f"first token {r['first_token_s']:.1f} s, {graphs}; phases {r['phases']}; "
            f"kernels {r['kernels']}, compile {r['compile_s']:.1f} s")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--models", default="llama2-7b,tiny",
                    help="comma-separated: llama2-7b, tiny")
    ap.add_argument("--max-num-seqs", type=int, default=64)
    ap.add_argument("--num-pages", type=int, default=2048,
                    help="arena pages (16-token blocks at 7B shapes: 32k tokens of KV)")
    ap.add_argument("--timeout-s", type=float, default=240.0, help="per start")
    ap.add_argument("--graphs-wait-s", type=float, default=150.0,
                    help="per start: how long after its first token to wait for its graphs")
    ap.add_argument("--budget-s", type=float, default=510.0,
                    help="the whole run: starts are cut to fit (the device allows 600 s)")
    ap.add_argument("--keep-page-cache", action="store_true",
                    help="do not drop the model files from the page cache before cold starts")
    ap.add_argument("--graphs-in-background", action="store_true",
                    help="every start captures its CUDA graphs while already serving eagerly "
                         "(without this flag: before ready, the worker's default)")
    ap.add_argument("--also-background", action="store_true",
                    help="one more warm start of each model with --graphs-in-background")
    ap.add_argument("--smoke", action="store_true", help="CPU, tiny model, small arena")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    if args.smoke:
        args.device, args.models, args.num_pages, args.max_num_seqs = "cpu", "tiny", 64, 4
        args.timeout_s, args.budget_s = min(args.timeout_s, 150.0), min(args.budget_s, 360.0)
    models = [m.strip() for m in args.models.split(",") if m.strip()]
    unknown = set(models) - set(DTYPES)
    if unknown:
        ap.error(f"unknown models {sorted(unknown)}; choose from {sorted(DTYPES)}")
    result: dict[str, Any] = {
        **run_record(["bench.worker_startup", *(argv if argv is not None else sys.argv[1:])]),
        "device": args.device, "max_num_seqs": args.max_num_seqs, "num_pages": args.num_pages,
        "graphs_in_background": args.graphs_in_background,
        "cpus": os.cpu_count(), "models": {}}
    budget = Budget(args.budget_s, (3 if args.also_background else 2) * len(models))
    with tempfile.TemporaryDirectory(prefix="slora-startup-") as tmp:
        for name in models:
            result["models"][name] = run_model(name, Path(tmp), args, budget)
            if args.out:
                Path(args.out).write_text(json.dumps(result, indent=1))
    served = all(r[k].get("served") for r in result["models"].values() for k in ("cold", "warm"))
    return 0 if served else 1


if __name__ == "__main__":
    exit_on_sigterm()  # a time limit still stops the worker (`finally`)
    sys.exit(main())
