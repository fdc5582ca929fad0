"""bench.process_cpu: each role's CPU share during a run, read from /proc."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from bench.process_cpu import StackCpu, spawned

# A "worker front" that sleeps while the core it spawned (multiprocessing, spawn) burns CPU,
# and a "gateway" with no spawned children, serving (burning) itself.
FRONT = """
import multiprocessing, sys, time
def burn():
    while True:
        pass
if __name__ == "__main__":
    child = multiprocessing.get_context("spawn").Process(target=burn, daemon=True)
    child.start()
    print(child.pid, flush=True)
    time.sleep(60)
"""
BURN = "print(0, flush=True)\nwhile True:\n    pass\n"


def test_roles_get_their_processes_and_their_shares(tmp_path: Path) -> None:
    (tmp_path / "front.py").write_text(FRONT)
    front = subprocess.Popen([sys.executable, str(tmp_path / "front.py")],
                             stdout=subprocess.PIPE, text=True)
    gateway = subprocess.Popen([sys.executable, "-c", BURN], stdout=subprocess.PIPE, text=True)
    core_pid = 0
    try:
        assert front.stdout is not None and gateway.stdout is not None
        core_pid = int(front.stdout.readline())
        gateway.stdout.readline()
        # multiprocessing's start() returns once the core is forked, maybe before its exec
        # (a fork still runs the front's command line): a stack is measured once it is up.
        deadline = time.monotonic() + 10
        while b"spawn_main" not in Path(f"/proc/{core_pid}/cmdline").read_bytes():
            assert time.monotonic() < deadline, "the core never ran spawn_main"
            time.sleep(0.01)
        cpu = StackCpu.of(front.pid, gateway.pid)
        assert cpu.roles == {"worker_front": [front.pid], "engine_core": [core_pid],
                             "gateway": [gateway.pid]}
        assert spawned(gateway.pid) == []
        cpu.start()
        t0 = time.monotonic()
        time.sleep(1.5)
        busy = cpu.busy(time.monotonic() - t0)
        assert set(busy) == {"worker_front", "engine_core", "gateway_busiest", "gateway_mean"}
        # The burners ran (shared with whatever else runs on this 2-core host); the front slept.
        assert busy["engine_core"] > 0.25 and busy["gateway_busiest"] > 0.25, busy
        assert busy["gateway_mean"] == busy["gateway_busiest"]
        assert busy["worker_front"] < 0.1, busy
    finally:
        if core_pid:  # the front's SIGKILL leaves its core running
            os.kill(core_pid, signal.SIGKILL)
        for p in (front, gateway):
            p.kill()
            p.wait()
