"""Device timing for the kernel benchmarks: CUDA-graph replay, so Python launch overhead stays
out of the numbers, over rotating input sets, so repeated calls do not just measure the L2."""

from __future__ import annotations

import os
import statistics
import time
from collections.abc import Callable, Sequence

import torch

# `SLORA_BENCH_DEVICE=cpu` runs the whole benchmark at toy sizes on Triton's interpreter, with
# wall-clock timing: a smoke test of the benchmark code, not a measurement.
DEVICE = os.environ.get("SLORA_BENCH_DEVICE", "cuda")
# Bytes a rotation should cover before repeated calls stop fitting in the H200's 60 MB of L2.
ROTATION_BYTES = 256 << 20
MAX_ROTATION = 32
MIN_CALLS_PER_GRAPH = 24


def rotation_count(bytes_per_call: int) -> int:
    """How many distinct input sets to cycle through so that one pass exceeds the L2 by 4x."""
    return max(1, min(MAX_ROTATION, -(-ROTATION_BYTES // max(1, bytes_per_call))))


def graph_time_us(calls: Sequence[Callable[[], object]], replays: int = 15) -> float:
    """Median device time of one call, in microseconds, from replaying a CUDA graph that runs
    every call of `calls` in order (each typically reads its own input set), repeated until
    the graph holds at least MIN_CALLS_PER_GRAPH calls."""
    if DEVICE == "cpu":
        t0 = time.perf_counter()
        for call in calls:
            call()
        return (time.perf_counter() - t0) * 1e6 / len(calls)
    repeat = max(1, -(-MIN_CALLS_PER_GRAPH // len(calls)))
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up: compiles kernels, creates library handles
        for call in calls:
            call()
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(repeat):
            for call in calls:
                call()
    graph.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(replays):
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    del graph
    return statistics.median(times) * 1000.0 / (repeat * len(calls))


def copy_bandwidth_gbs(nbytes: int) -> dict[str, float]:
    """Device-to-device copy bandwidth, counting bytes read plus bytes written (GB/s), two
    ways: a graph memcpy node (which ran at about 2.7 TB/s on the H200, likely on the copy
    engines) and an elementwise kernel on the multiprocessors, the path our kernels take."""
    src = torch.empty(nbytes // 2, dtype=torch.float16, device=DEVICE).normal_()
    dst = torch.empty_like(src)
    memcpy_us = graph_time_us([lambda: dst.copy_(src)], replays=10)
    kernel_us = graph_time_us([lambda: torch.mul(src, 1.0, out=dst)], replays=10)
    return {"memcpy": 2 * nbytes / (memcpy_us * 1e3), "kernel": 2 * nbytes / (kernel_us * 1e3)}
