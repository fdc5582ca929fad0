"""Where the GPU time of a step goes, by kernel family (torch.profiler's CUDA timings), for the
two shapes issue 6 measures: the 32-request / 32-adapter prefill (prompt 256) and the batch-64
decode step (64 distinct rank-16 adapters, context ~512). Eager steps, so every kernel shows.

    python -m bench.profile_gpu --shape llama2-7b --out /tmp/profile.json
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

from bench.kernel_families import family_of
from bench.run_record import run_record
from bench.serving import Bench
from slora_core.engine import LLMEngine
from slora_core.sampling_params import SamplingParams
from slora_kernels.jit_stats import compiled_kernel_variants

FAMILIES = (
    ("lora_shrink", ("_lora_shrink",)), ("lora_expand", ("_lora_expand",)),
    ("attention_decode", ("decode",)), ("attention_prefill", ("prefill",)),
    ("write_kv", ("write_kv",)), ("rmsnorm", ("rms_norm", "rmsnorm")), ("rotary", ("rotary",)),
    ("silu_mul", ("silu",)), ("gemm", ("gemm", "cutlass", "nvjet", "sm90", "xmma", "cublas")),
    ("copy_fill", ("copy", "fill", "memcpy", "memset", "elementwise", "index")),
)


def family(name: str) -> str:
    return family_of(name, FAMILIES)


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def profiled_steps(engine: LLMEngine, steps: int) -> dict[str, Any]:
    """Run `steps` engine steps under the profiler; device microseconds per step by family
    (on a CPU-only machine, CPU op times: only to try the script)."""
    sync()
    cuda = torch.cuda.is_available()
    with profile(activities=[ProfilerActivity.CUDA if cuda else ProfilerActivity.CPU]) as prof:
        for _ in range(steps):
            engine.step()
        sync()
    by_fam: dict[str, float] = defaultdict(float)
    top: list[tuple[float, str, int]] = []
    for ev in prof.key_averages():
        us = ev.device_time_total if cuda else ev.self_cpu_time_total
        if us <= 0:
            continue
        by_fam[family(ev.key)] += us / steps
        top.append((us / steps, ev.key[:90], ev.count // steps))
    top.sort(reverse=True)
    return {"gpu_us_per_step": dict(sorted(by_fam.items(), key=lambda kv: -kv[1])),
            "gpu_us_total": sum(by_fam.values()),
            "top_kernels": [{"us": round(u, 1), "name": n, "calls": c} for u, n, c in top[:25]]}


def timed_steps(engine: LLMEngine, steps: int) -> list[dict[str, float]]:
    rows = []
    for _ in range(steps):
        sync()
        compiled = compiled_kernel_variants()
        t0 = time.perf_counter()
        engine.step()
        sync()
        rows.append({"ms": (time.perf_counter() - t0) * 1e3,
                     "distinct": engine.stats.last_distinct_adapters,
                     "compiles": compiled_kernel_variants() - compiled})
    return rows


def graph_replay_ms(engine: LLMEngine, replays: int = 20) -> dict[str, float]:
    """GPU time of the decode graph alone (CUDA events around back-to-back replays)."""
    graphs = engine.runner.graphs
    if graphs is None or not torch.cuda.is_available():
        return {}
    out = {}
    for key, graph in graphs.graphs.items():
        if key[0] != 64:
            continue
        graph.replay()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(replays):
            graph.replay()
        end.record()
        torch.cuda.synchronize()
        # Graphs of one bucket and module set differ in their tile list's capacity (key[2]).
        out[f"b64-modules{sorted(key[1])}-tiles{key[2]}"] = start.elapsed_time(end) / replays
    return out


def add(engine: LLMEngine, tag: str, n: int, prompt: int, new: int, vocab: int,
        seed: int) -> None:
    rng = np.random.default_rng(seed)
    for i in range(n):
        engine.add_request(f"{tag}{i}", rng.integers(3, vocab, prompt).tolist(),
                           SamplingParams(temperature=0, max_new_tokens=new, ignore_eos=True),
                           adapter=f"a{i}")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", default="llama2-7b")
    ap.add_argument("--dtype", default="float16")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    ns = argparse.Namespace(shape=args.shape, dtype=args.dtype, device=args.device,
                            arena_gb=40.0 if args.device == "cuda" else 0.05,
                            max_num_seqs=64, max_num_batched_tokens=4096,
                            max_adapters_per_batch=64)
    bench = Bench(ns)
    vocab = bench.cfg.vocab_size
    result: dict[str, Any] = run_record(["bench.profile_gpu", *sys.argv[1:]])

    # 32 x 32 prefill: first round loads the adapters, the second finds them resident.
    engine = bench.engine(32, (16,), cuda_graphs=False, max_adapters_per_batch=32)
    add(engine, "r1-", 32, 256, 8, vocab, 3)
    result["prefill_round1_steps"] = timed_steps(engine, 4)
    while engine.has_unfinished():
        engine.step()
    add(engine, "r2-", 32, 256, 8, vocab, 4)
    result["prefill_round2_steps"] = timed_steps(engine, 2)
    while engine.has_unfinished():
        engine.step()
    add(engine, "r3-", 32, 256, 8, vocab, 5)
    result["prefill_profile"] = profiled_steps(engine, 2)
    del engine

    # Batch-64 decode, context ~512, 64 distinct adapters: eager (profiled) and graphs (timed).
    for graphs in (False, True):
        engine = bench.engine(64, (16,), cuda_graphs=graphs, max_adapters_per_batch=64)
        add(engine, "d", 64, 512, 64, vocab, 6)
        while any(s.num_computed_tokens < len(s.prompt_token_ids)
                  for s in engine.scheduler.running) or engine.num_waiting:
            engine.step()
        key = "graphs" if graphs else "eager"
        result[f"decode_{key}_steps"] = timed_steps(engine, 6)
        if not graphs:
            result["decode_profile"] = profiled_steps(engine, 5)
        else:
            result["decode_graph_replay_ms"] = graph_replay_ms(engine)
        del engine
    result["warmup_s"] = bench.warmup_s

    for name in ("prefill_profile", "decode_profile"):
        print(f"--- {name}: total GPU {result[name]['gpu_us_total']:.0f} us/step")
        for fam, us in result[name]["gpu_us_per_step"].items():
            print(f"  {fam:18s} {us:9.0f} us")
        for row in result[name]["top_kernels"][:12]:
            print(f"  {row['us']:9.1f} us x{row['calls']:4d}  {row['name']}")
    for k in ("prefill_round1_steps", "prefill_round2_steps", "decode_eager_steps",
              "decode_graphs_steps"):
        print(k, [(round(r["ms"], 2), r["compiles"]) for r in result[k]])
    print("graph replay ms", result.get("decode_graph_replay_ms"))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
