"""Child processes that must not outlive their parent: the worker's engine core, tensor-parallel
ranks, gateway processes. An orphan would hold its GPU, or its port, until someone kills it."""

from __future__ import annotations

import ctypes
import gc
import logging
import os
import signal
import sys

log = logging.getLogger(__name__)
PR_SET_PDEATHSIG = 1


def die_with_parent(parent_pid: int, sig: int = signal.SIGKILL) -> None:
    """Ask Linux to send `sig` to this process when its parent dies, and exit at once if the
    parent is already gone (it died before prctl took effect). Without prctl only the callers'
    own parent-pid checks remain."""
    if sys.platform.startswith("linux"):
        try:
            ctypes.CDLL("libc.so.6", use_errno=True).prctl(PR_SET_PDEATHSIG, sig)
        except OSError:
            log.warning("prctl(PR_SET_PDEATHSIG) unavailable; relying on the parent-pid check")
    if os.getppid() != parent_pid:
        os._exit(1)


def cgroup_cpus() -> float | None:
    """The cgroup v2 CPU quota in cores (None when unlimited or unreadable)."""
    try:
        with open("/sys/fs/cgroup/cpu.max") as f:
            quota, period = f.read().split()
    except (OSError, ValueError):
        return None
    return None if quota == "max" else int(quota) / int(period)


def usable_cpus() -> int:
    """CPUs this process may run on: its affinity set, cut to the cgroup v2 quota if one is
    set (a container can see every core of its host and be allowed a few)."""
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    quota = cgroup_cpus()
    return min(cpus or 1, max(1, int(quota))) if quota is not None else cpus or 1


def share_cpu_threads(processes: int) -> None:
    """torch's CPU thread pool sized to this process's share of the usable CPUs, when the
    user set no OMP_NUM_THREADS. torch's default is every core the process can see, per
    process: N engine processes on one host then oversubscribe the cores, and idle threads
    spinning for work slow the host-side work (adapter loads, input building) many times."""
    if os.environ.get("OMP_NUM_THREADS"):
        return
    import torch

    torch.set_num_threads(max(1, min(torch.get_num_threads(), usable_cpus() // processes)))


def freeze_startup_heap() -> None:
    """Move every object alive now out of the garbage collector's reach (`gc.freeze`). Called
    once a serving process has loaded and warmed up: the model, torch's and the libraries'
    objects (~400k tracked objects after the imports alone) live as long as the process, and
    a full collection that scans them all stalls the step loop for 0.1-0.2 s (`python -m
    bench.serving --scenarios gcpause`, bench/results/gc-pauses-cpu.json); after the freeze a
    collection scans only what serving created."""
    gc.collect()
    gc.freeze()
