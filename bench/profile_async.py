"""Where a batch-64 decode step's time goes beyond the GPU's own work, with synchronous and
asynchronous steps: the floor scenario's engine (Llama-2-7B shapes, 64 distinct rank-16
adapters, context ~512, CUDA graphs) timed three ways, then profiled.

- `graph_replay_ms`: each batch-64 decode graph alone (by module set and tile-list capacity),
  back-to-back replays (CUDA events);
- `step_ms`: engine steps back to back, the device synced only at both ends of the window;
- `graph_in_step`: the graph's GPU time inside engine steps (events around each replay) and
  the device time between replays;
- `host_ms_per_step`: the same steps' host time by phase, `wait` the time blocked on the
  previous step's tokens (near 0: the host, not the GPU, sets the pace);
- `profile`: torch.profiler over a few steps (and `replay_profile`: the graph those steps
  replayed, replayed alone, GPU time per kernel beside the steps'): the fraction of the window the GPU is busy
  (union of kernels and copies), the host's CUDA runtime calls per step (a synchronize or a
  blocking copy there stalls the next launch), and the longest GPU idle gaps with the host
  work running in them (innermost op and its slora frames).

    python -m bench.profile_async --shape llama2-7b --out bench/results/profile-async-h200.json
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections import defaultdict
from typing import Any

import numpy as np
import torch
from torch.profiler import ProfilerActivity, profile

from bench.profile_core import PhaseTimer
from bench.profile_gpu import graph_replay_ms, sync
from bench.run_record import run_record
from bench.serving import FLOOR_BATCH, FLOOR_CONTEXT, Bench, floor_engine
from slora_core import model_runner
from slora_core.engine import LLMEngine
from slora_core.sampler import PendingSample


def step_ms(engine: LLMEngine, steps: int) -> float:
    sync()
    t0 = time.perf_counter()
    for _ in range(steps):
        engine.step()
    sync()
    return (time.perf_counter() - t0) * 1e3 / steps


def host_phases(engine: LLMEngine, steps: int) -> dict[str, float]:
    """Host milliseconds per step in each phase, steps back to back (no sync between them):
    `wait` is the time blocked on the previous step's tokens; the rest is host work."""
    timer = PhaseTimer(sync=False)
    phases = ((engine.scheduler, "schedule", "schedule"),
              (model_runner, "build_step_inputs", "inputs"), (engine.runner, "run", "launch"),
              (engine.sampler, "sample", "sample_sync_incl_wait"),
              (engine.sampler, "sample_async", "sample_launch"),
              (PendingSample, "result", "wait"))
    saved = [(owner, name, getattr(owner, name)) for owner, name, _ in phases]
    for owner, name, phase in phases:
        timer.wrap(owner, name, phase)
    totals: dict[str, float] = defaultdict(float)
    sync()
    t0 = time.perf_counter()
    try:
        for _ in range(steps):
            timer.step = defaultdict(float)
            engine.step()
            for k, v in timer.step.items():
                totals[k] += v
        sync()
    finally:
        for owner, name, fn in saved:
            setattr(owner, name, fn)
    out = {k: v / steps for k, v in totals.items()}
    out["launch"] = out.get("launch", 0.0) - out.get("inputs", 0.0)  # run() builds the inputs
    out["step_wall"] = (time.perf_counter() - t0) * 1e3 / steps
    return out


def graph_in_step_ms(engine: LLMEngine, steps: int
                     ) -> tuple[dict[str, float], torch.cuda.CUDAGraph | None]:
    """The graph's own GPU time inside engine steps (CUDA events around each replay), the
    time from one replay's end to the next one's start (the step's work outside the graph,
    plus any idle time), and the graph the steps replayed last."""
    if not torch.cuda.is_available():
        return {}, None
    original = torch.cuda.CUDAGraph.replay
    marks: list[tuple[torch.cuda.Event, torch.cuda.Event]] = []
    replayed: list[torch.cuda.CUDAGraph] = []

    def replay(graph: torch.cuda.CUDAGraph) -> None:
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        original(graph)
        end.record()
        marks.append((start, end))
        replayed.append(graph)

    setattr(torch.cuda.CUDAGraph, "replay", replay)  # noqa: B010 (a method swapped in)
    try:
        for _ in range(steps):
            engine.step()
        sync()
    finally:
        setattr(torch.cuda.CUDAGraph, "replay", original)  # noqa: B010
    inside = [s.elapsed_time(e) for s, e in marks]
    between = [marks[i][1].elapsed_time(marks[i + 1][0]) for i in range(len(marks) - 1)]
    return ({"replays": len(marks), "graph_ms": float(np.mean(inside)),
             "graph_ms_min": float(np.min(inside)), "between_ms": float(np.mean(between))},
            replayed[-1] if replayed else None)


def _union_us(intervals: list[tuple[float, float]]) -> float:
    busy, end = 0.0, float("-inf")
    for s, e in sorted(intervals):
        if e > end:
            busy += e - max(s, end)
            end = e
    return busy


def _frames(ev: Any) -> list[str]:
    return [f for f in (ev.stack or []) if "slora" in f or "slora_kernels/" in f][:4]


def gpu_ops(prof: Any, per: int) -> dict[str, dict[str, float]]:
    """GPU time and count per kernel (or copy) name, per step, the 15 largest."""
    rows = [(ev.device_time_total / per, ev.count / per, ev.key[:80])
            for ev in prof.key_averages() if ev.device_time_total > 0]
    rows.sort(reverse=True)
    return {name: {"us": us, "calls": calls} for us, calls, name in rows[:15]}


def profiled_replay(graph: torch.cuda.CUDAGraph | None, replays: int) -> dict[str, Any]:
    """The graph the steps replayed, replayed alone under the profiler: the same breakdown."""
    if graph is None:
        return {}
    sync()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(replays):
            graph.replay()
        sync()
    return {"top_gpu_ops_per_replay": gpu_ops(prof, replays)}


def profiled(engine: LLMEngine, steps: int) -> dict[str, Any]:
    sync()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA],
                 with_stack=True) as prof:
        for _ in range(steps):
            engine.step()
        sync()
    events = list(prof.events())
    gpu = sorted((ev.time_range.start, ev.time_range.end) for ev in events
                 if ev.device_type.name == "CUDA" and ev.time_range.end > ev.time_range.start)
    cpu = [ev for ev in events if ev.device_type.name == "CPU"]
    runtime: dict[str, list[float]] = defaultdict(list)
    for ev in cpu:
        if ev.name.startswith("cuda"):
            runtime[ev.name].append(ev.time_range.end - ev.time_range.start)
    out: dict[str, Any] = {"steps": steps, "runtime_calls_per_step": {
        name: {"calls": len(v) / steps, "us": sum(v) / steps}
        for name, v in sorted(runtime.items(), key=lambda kv: -sum(kv[1]))[:12]},
        "top_gpu_ops_per_step": gpu_ops(prof, steps)}
    if not gpu:
        return out
    window = gpu[-1][1] - gpu[0][0]
    out["gpu_window_us"] = window
    out["gpu_busy_fraction"] = _union_us(gpu) / window
    gaps: list[tuple[float, float]] = []
    end = gpu[0][1]
    for s, e in gpu[1:]:
        if s > end:
            gaps.append((s - end, end))
        end = max(end, e)
    gaps.sort(reverse=True)
    out["gaps_over_50us_per_step"] = {"count": sum(g > 50 for g, _ in gaps) / steps,
                                      "us": sum(g for g, _ in gaps if g > 50) / steps}
    rows = []
    for length, start in gaps[:8]:
        mid = start + length / 2
        live = [ev for ev in cpu if ev.time_range.start <= mid <= ev.time_range.end]
        inner = min(live, key=lambda ev: ev.time_range.end - ev.time_range.start, default=None)
        rows.append({"gap_us": length, "host_op": inner.name if inner else None,
                     "frames": _frames(inner) if inner else [],
                     "host_ops": sorted({ev.name for ev in live})[:8]})
    out["longest_gaps"] = rows
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--shape", default="llama2-7b")
    ap.add_argument("--dtype", default="float16")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--profile-steps", type=int, default=6)
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    cuda = args.device.startswith("cuda")
    ns = argparse.Namespace(shape=args.shape, dtype=args.dtype, device=args.device,
                            arena_gb=40.0 if cuda else 0.05, max_num_seqs=FLOOR_BATCH,
                            max_num_batched_tokens=4096, max_adapters_per_batch=FLOOR_BATCH)
    bench = Bench(ns)
    result: dict[str, Any] = {**run_record(["bench.profile_async", *(argv or sys.argv[1:])]),
                              "batch": FLOOR_BATCH, "context": FLOOR_CONTEXT, "modes": {}}
    for async_steps in (False, True):
        engine = floor_engine(bench, new_tokens=200, warm_steps=5, async_steps=async_steps)
        mode: dict[str, Any] = {"step_ms": step_ms(engine, args.steps),
                                "host_ms_per_step": host_phases(engine, args.steps)}
        mode["graph_in_step"], graph = graph_in_step_ms(engine, args.steps)
        mode |= {"graph_replay_ms": graph_replay_ms(engine),
                 "profile": profiled(engine, args.profile_steps),
                 "replay_profile": profiled_replay(graph, args.profile_steps)}
        mode["step_ms_after_profile"] = step_ms(engine, args.steps)
        name = "async" if async_steps else "sync"
        result["modes"][name] = mode
        prof = mode["profile"]
        print(f"== {name}: step {mode['step_ms']:.2f} ms, graph {mode['graph_replay_ms']}, "
              f"GPU busy {prof.get('gpu_busy_fraction', 0):.3f}, gaps>50us/step "
              f"{prof.get('gaps_over_50us_per_step')}", flush=True)
        print(f"   graph inside steps: {mode['graph_in_step']}")
        print("   host ms/step: " + "  ".join(
            f"{k} {v:.2f}" for k, v in mode["host_ms_per_step"].items()))
        for g in prof.get("longest_gaps", [])[:4]:
            print(f"   gap {g['gap_us']:.0f} us: {g['host_op']} {g['frames'][:2]}")
        replay = mode["replay_profile"].get("top_gpu_ops_per_replay", {})
        for op, row in list(prof["top_gpu_ops_per_step"].items())[:12]:
            alone = replay.get(op, {}).get("us", 0.0)
            print(f"   {row['us']:8.1f} us/step x{row['calls']:5.1f} (replay {alone:8.1f})  {op}")
        del engine
        if args.out:
            with open(args.out, "w") as f:
                json.dump(result, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
