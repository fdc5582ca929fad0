"""How busy a local stack's processes were during a run: CPU seconds (user + system, from
/proc) over the run's wall time, per role.

A single-threaded asyncio process near 1.0 has no idle turn left: whatever reaches it waits
for the turns ahead of it. At 256 streams through the gateway, a request's hop from the
gateway's entry to the worker's took 5.1-5.2 ms p50 against 0.8-1.0 ms at 64 (H100,
service-overhead-7b-gw4-admission-spread32-8461c0f-h100.json's hops), and direct to the worker
+172-401 ms on slow hosts: these shares say whether the worker's front is the process that
ran out of turns.

Roles: `worker_front` (the worker's gRPC process), `engine_core` (its spawned core), and the
gateway's serving processes (`gateway_busiest` and `gateway_mean`: with `--processes N` the
supervisor's N spawned children, else the gateway process itself).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from pathlib import Path

from bench.grpc_stream_cost import cpu_s


def children(pid: int) -> list[int]:
    """The live children of `pid`, [] once it is gone. Read from every process's stat (its
    parent's pid): /proc/PID/task/*/children is reliable only for stopped tasks (proc(5)),
    and under load it missed a spawned engine core."""
    found: list[int] = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            # "pid (comm) state ppid ...": comm may hold spaces and parentheses.
            ppid = int(stat.read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue  # gone meanwhile
        if ppid == pid:
            found.append(int(stat.parent.name))
    return sorted(found)


def spawned(pid: int) -> list[int]:
    """The children of `pid` that multiprocessing spawned to run a target (its resource
    tracker and other helpers left out)."""
    out = []
    for child in children(pid):
        try:
            cmdline = Path(f"/proc/{child}/cmdline").read_bytes()
        except OSError:
            continue
        if b"spawn_main" in cmdline:
            out.append(child)
    return out


@dataclass
class StackCpu:
    """Roles -> pids of one worker and one gateway, and their CPU seconds at `start()`."""

    roles: dict[str, list[int]]
    _at_start: dict[int, float] = field(default_factory=dict)

    @classmethod
    def of(cls, worker_pid: int, gateway_pid: int) -> StackCpu:
        gateways = spawned(gateway_pid) or [gateway_pid]  # one process: it serves itself
        return cls({"worker_front": [worker_pid], "engine_core": spawned(worker_pid),
                    "gateway": gateways})

    def _now(self) -> dict[int, float]:
        got = {}
        for pids in self.roles.values():
            for pid in pids:
                with contextlib.suppress(OSError):  # gone: its share is unknown
                    got[pid] = cpu_s(pid)
        return got

    def start(self) -> None:
        self._at_start = self._now()

    def busy(self, wall_s: float) -> dict[str, float]:
        """Each role's CPU seconds since `start()` over `wall_s`: the worker front's and the
        core's, and the busiest and mean gateway process's."""
        now = self._now()
        share = {pid: (now[pid] - self._at_start[pid]) / wall_s
                 for pid in now if pid in self._at_start}
        out: dict[str, float] = {}
        for role, pids in self.roles.items():
            got = [share[p] for p in pids if p in share]
            if not got:
                continue
            if role == "gateway":
                out["gateway_busiest"] = round(max(got), 3)
                out["gateway_mean"] = round(sum(got) / len(got), 3)
            else:
                out[role] = round(sum(got), 3)
        return out
