"""slora_core.process: the CPU thread share of engine processes."""

from __future__ import annotations

import os
import subprocess
import sys

from slora_core.process import usable_cpus

PROBE = ("import torch; from slora_core.process import share_cpu_threads, usable_cpus; "
         "before = torch.get_num_threads(); share_cpu_threads({n}); "
         "print(before, torch.get_num_threads(), usable_cpus())")


def _run(n: int, omp: str | None) -> list[int]:
    env = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}
    if omp is not None:
        env["OMP_NUM_THREADS"] = omp
    out = subprocess.run([sys.executable, "-c", PROBE.format(n=n)], env=env, check=True,
                         capture_output=True, text=True).stdout.split()
    return [int(x) for x in out]


def test_usable_cpus_is_within_the_affinity_set() -> None:
    assert 1 <= usable_cpus() <= len(os.sched_getaffinity(0))


def test_each_process_gets_its_share_of_the_cpus() -> None:
    before, after, cpus = _run(2, None)
    assert after == max(1, min(before, cpus // 2))
    before, after, cpus = _run(1, None)
    assert after == min(before, cpus)


def test_a_users_omp_num_threads_is_kept() -> None:
    # 64 processes' share would be one thread on this host; the user's 2 stays.
    before, after, _ = _run(64, "2")
    assert before == after == 2
