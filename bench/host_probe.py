"""What the host side of a GPU machine does to an adapter load: CPU counts (affinity, cgroup
quota), torch's thread count, and the time of the loader's own CPU work on 7B-shaped adapter
tensors (is-finite checks and the float32 -> float16 cast) at several thread counts, with
fresh allocations each pass and with buffers reused.

The tensor-parallel 7b part spent over 80 s registering four peft adapters on the H200
(tp-7b log at beadb55; 2.8 s for the largest on a 2-core CPU here), so this says whether
threads or fresh memory are the cost.

    python -m bench.host_probe --out /tmp/host-probe.json
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import torch

from bench.run_record import commit_id
from slora_core.process import cgroup_cpus


def work(threads: int, fresh: bool, numel: int, passes: int) -> float:
    """Seconds per pass of the loader's to_dtype on `numel` float32 values in 64 tensors."""
    torch.set_num_threads(threads)
    parts = [torch.randn(numel // 64) for _ in range(64)]
    outs = [torch.empty(numel // 64, dtype=torch.float16) for _ in range(64)]
    t0 = time.perf_counter()
    for _ in range(passes):
        for i, t in enumerate(parts):
            assert bool(torch.isfinite(t).all())
            if fresh:
                out = t.to(torch.float16)
            else:
                out = outs[i]
                out.copy_(t)
            assert bool(torch.isfinite(out).all())
    return (time.perf_counter() - t0) / passes


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--numel", type=int, default=80_000_000, help="one r32 all-linear 7B adapter")
    ap.add_argument("--passes", type=int, default=2)
    ap.add_argument("--threads", type=int, nargs="+", default=[0, 8, 1],
                    help="0: torch's default")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    default = torch.get_num_threads()
    report: dict[str, Any] = {
        "command": " ".join(["python -m bench.host_probe", *sys.argv[1:]]),
        "commit": commit_id(), "os_cpu_count": os.cpu_count(),
        "affinity_cpus": len(os.sched_getaffinity(0)), "cgroup_cpus": cgroup_cpus(),
        "torch_default_threads": default, "omp_num_threads_env": os.environ.get("OMP_NUM_THREADS"),
        "nproc": subprocess.run(["nproc"], capture_output=True, text=True).stdout.strip(),
        "runtime": Path("/proc/version").read_text().strip()[:120], "seconds_per_pass": {}}
    for n in args.threads:
        for fresh in (True, False):
            key = f"threads={n or default} {'fresh' if fresh else 'reused'}"
            report["seconds_per_pass"][key] = round(work(n or default, fresh, args.numel,
                                                         args.passes), 3)
            print(key, report["seconds_per_pass"][key], flush=True)
    text = json.dumps(report, indent=1)
    if args.out:
        Path(args.out).write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
