"""Where a decode step's time goes: per-phase wall times (synchronised) and a cProfile of the
host side, for the 32-request / 32-adapter batch at Llama-2-7B shapes.

    python -m bench.profile_step --shape llama2-7b
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import time

import numpy as np
import torch

from bench.serving import Bench
from slora_core.sampling_params import SamplingParams


def timed_steps(engine, n: int) -> list[dict[str, float]]:
    rows = []
    for _ in range(n):
        t0 = time.perf_counter()
        sched = engine.scheduler.schedule()
        t1 = time.perf_counter()
        engine._apply_memory_changes(sched)
        torch.cuda.synchronize()
        t2 = time.perf_counter()
        logits = engine.runner.run(sched.scheduled)
        torch.cuda.synchronize()
        t3 = time.perf_counter()
        engine.loop.sample(sched, logits, [s.seq for s in sched.scheduled if s.samples])
        t4 = time.perf_counter()
        rows.append({"tokens": sched.num_tokens, "seqs": len(sched.scheduled),
                     "schedule_ms": (t1 - t0) * 1e3, "memory_ms": (t2 - t1) * 1e3,
                     "forward_ms": (t3 - t2) * 1e3, "sample_ms": (t4 - t3) * 1e3})
    return rows


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", default="llama2-7b")
    ap.add_argument("--dtype", default="float16")
    ap.add_argument("--device", default="cuda")
    args = ap.parse_args()
    ns = argparse.Namespace(shape=args.shape, dtype=args.dtype, device=args.device, arena_gb=20.0,
                            max_num_seqs=64, max_num_batched_tokens=4096,
                            max_adapters_per_batch=64)
    bench = Bench(ns)
    rng = np.random.default_rng(3)
    for graphs in (True, False):
        engine = bench.engine(32, (16,), cuda_graphs=graphs)
        for i in range(32):
            engine.add_request(str(i), rng.integers(3, bench.cfg.vocab_size, 256).tolist(),
                               SamplingParams(temperature=0, max_new_tokens=60, ignore_eos=True),
                               adapter=f"a{i}")
        rows = timed_steps(engine, 12)
        print(f"--- cuda_graphs={graphs}")
        for r in rows:
            print("  ".join(f"{k}={v:.2f}" if isinstance(v, float) else f"{k}={v}"
                            for k, v in r.items()))
        prof = cProfile.Profile()
        prof.enable()
        timed_steps(engine, 20)
        prof.disable()
        s = io.StringIO()
        pstats.Stats(prof, stream=s).sort_stats("tottime").print_stats(18)
        print(s.getvalue()[-4500:])


if __name__ == "__main__":
    main()
