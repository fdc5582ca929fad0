"""Where a serving process's start-up time goes: named phases with their seconds and the
kernels Triton compiled or found in its cache during each.

    profile = StartupProfile(stats)          # stats: compile_cache.CompileStats, or None
    with profile.phase("weights"):
        model = load_model(...)
    profile.add("graph_capture", 0.8, graphs="decode", bucket=64)
    log.info("%s", profile.format())

Phases (the worker's, in order): `process` (the front process from its creation until it
spawns the engine core: interpreter, imports, tokenizer), `core_spawn` (the engine-core process
starting and importing torch), `weights` (checkpoint into device memory), `arena` (page arena,
runner, graph buffers), `graph_capture` (one record a CUDA graph, CUDA only: before ready, or
`background` ones captured between steps once the worker serves), `warmup` (a request served
end to end: Triton compiles, or loads from its cache, the kernels its steps launch), `server`
(the front's gRPC server and metrics endpoint).
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

from slora_core.compile_cache import CompileStats

# Phase names, in the order a worker meets them (format() and the metric keep this order).
PHASES = ("process", "core_spawn", "weights", "arena", "precompile", "graph_capture", "warmup",
          "server")


@dataclass(frozen=True)
class PhaseRecord:
    """One timed piece of start-up. `graphs`/`bucket` name a graph capture's graph set
    ("decode" or "mixed", with "+lora" for LoRA graphs) and bucket; `background` marks work
    done after the process was ready (graphs captured while serving)."""

    name: str
    seconds: float
    compiled: int = 0        # kernel binaries compiled in this phase
    cache_hits: int = 0      # kernel binaries loaded from the on-disk cache
    compile_s: float = 0.0   # seconds of those compilations (part of `seconds`)
    graphs: str = ""
    bucket: int = 0
    background: bool = False


@dataclass
class GraphLabel:
    """What a `graph_capture` phase captured (StartupProfile.phase)."""

    graphs: str = ""
    bucket: int = 0


@dataclass
class StartupProfile:
    """Phase records of one start; `stats` (optional) attributes kernel compilations."""

    stats: CompileStats | None = None
    clock: Callable[[], float] = time.perf_counter
    records: list[PhaseRecord] = field(default_factory=list)

    @contextmanager
    def phase(self, name: str, graphs: str = "", bucket: int = 0,
              background: bool = False) -> Iterator[GraphLabel]:
        """Time the block as phase `name` (recorded when the block ends, even by an error). The
        block may set the graph set and bucket it turned out to capture on the label given."""
        label = GraphLabel(graphs, bucket)
        before = self.stats.snapshot() if self.stats is not None else None
        t0 = self.clock()
        try:
            yield label
        finally:
            seconds = self.clock() - t0
            done = (self.stats.since(before) if self.stats is not None and before is not None
                    else CompileStats())
            self.records.append(PhaseRecord(name, seconds, done.compiled, done.cache_hits,
                                            done.compile_s, label.graphs, label.bucket,
                                            background))

    def add(self, name: str, seconds: float, **detail: object) -> None:
        """A phase timed elsewhere (e.g. by another process)."""
        self.records.append(PhaseRecord(name, seconds, **detail))  # type: ignore[arg-type]

    def totals(self) -> dict[str, float]:
        """Seconds by phase name (graph buckets summed), in PHASES order then others."""
        out: dict[str, float] = {}
        for name in (*PHASES, *(r.name for r in self.records)):
            if name not in out:
                secs = [r.seconds for r in self.records if r.name == name]
                if secs:
                    out[name] = sum(secs)
        return out

    def total_s(self, background: bool = False) -> float:
        """Seconds of every phase (with `background`: those after ready too)."""
        return sum(r.seconds for r in self.records if background or not r.background)

    def compile_totals(self) -> tuple[int, int, float]:
        """(kernels compiled, kernels loaded from cache, compile seconds) over every phase."""
        return (sum(r.compiled for r in self.records), sum(r.cache_hits for r in self.records),
                sum(r.compile_s for r in self.records))

    def format(self) -> str:
        """A few lines for the log: each phase's seconds and compilations, graphs summed."""
        lines = ["start-up profile:"]
        for name, secs in self.totals().items():
            rs = [r for r in self.records if r.name == name]
            extra = f"  ({len(rs)} graphs)" if name == "graph_capture" else ""
            if any(r.background for r in rs):
                extra += " in the background"
            compiled, hits = sum(r.compiled for r in rs), sum(r.cache_hits for r in rs)
            if compiled or hits:
                extra += (f"  kernels compiled {compiled} "
                          f"({sum(r.compile_s for r in rs):.1f} s), from cache {hits}")
            lines.append(f"  {name:<14}{secs:8.2f} s{extra}")
        lines.append(f"  {'phases total':<14}{self.total_s():8.2f} s")
        return "\n".join(lines)


def process_start_time(pid: int | None = None) -> float | None:
    """When process `pid` (default: this one) was created, as a time.time() value; None where
    /proc cannot tell (not Linux). Resolution: the kernel's clock tick (10 ms)."""
    try:
        with open(f"/proc/{pid or os.getpid()}/stat") as f:
            # Field 22 (starttime, in clock ticks since boot), counted after the command name,
            # which may itself hold spaces and parentheses.
            start_ticks = int(f.read().rsplit(")", 1)[1].split()[19])
        with open("/proc/uptime") as f:
            uptime = float(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return None
    # Age from the uptime clock (10 ms), not /proc/stat's btime (whole seconds).
    return time.time() - (uptime - start_ticks / os.sysconf("SC_CLK_TCK"))
