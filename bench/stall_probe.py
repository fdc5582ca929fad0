"""Run a command and, whenever its output stops growing, record what its processes are doing.

For runs that stop making progress without an error. Under it the row-kernel churn run
(c021796) showed its silent minutes to be the first engine warm-up, the main thread running
and waiting on the compiler, the GPU idle (bench/results/churn-rows-probe-c021796-h200.log):
the runs cut at 34c58cb and fd01907 had not stalled.

Each probe writes, for every process of the command's tree: its state and each thread's state
and kernel wait channel (and kernel stack where readable), then `nvidia-smi` (is the GPU busy:
a kernel that never ends, or idle: the host is stuck) and the kernel log's tail (Xid errors,
hung tasks). The command's own exit status is returned; at --limit it is sent SIGTERM, then
SIGKILL.

    python -m bench.stall_probe --log run.log --probe probe.log --quiet-s 25 --limit 140 -- CMD...
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import time
from pathlib import Path


def _read(path: Path) -> str:
    try:
        return path.read_text(errors="replace").strip()
    except OSError as e:
        return f"<{e.strerror}>"


def _tree(root: int) -> list[int]:
    """root and its descendants (by /proc/*/stat's parent pid)."""
    parent: dict[int, int] = {}
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            stat = _read(d / "stat")
            if ")" in stat:
                parent[int(d.name)] = int(stat.rsplit(")", 1)[1].split()[1])
    out, todo = [], [root]
    while todo:
        pid = todo.pop()
        out.append(pid)
        todo.extend(p for p, pp in parent.items() if pp == pid)
    return out


def _shell(cmd: list[str]) -> str:
    try:
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=20)
        return (r.stdout + r.stderr).strip()
    except (OSError, subprocess.TimeoutExpired) as e:
        return f"<{cmd[0]}: {e}>"


def probe(root: int, quiet_s: float) -> str:
    lines = [f"=== probe after {quiet_s:.0f} s without output, {time.strftime('%H:%M:%S')}"]
    for pid in _tree(root):
        proc = Path(f"/proc/{pid}")
        cmdline = _read(proc / "cmdline").replace("\0", " ")[:160]
        lines.append(f"pid {pid}: {cmdline}")
        for task in sorted((proc / "task").glob("*"), key=lambda p: int(p.name)):
            stat = _read(task / "stat")
            state = stat.rsplit(")", 1)[1].split()[0] if ")" in stat else "?"
            name = stat[stat.find("(") + 1 : stat.rfind(")")]
            lines.append(f"  tid {task.name} {name!r} state {state} wchan "
                         f"{_read(task / 'wchan') or '-'}")
            if state == "D":
                lines.extend("    " + s for s in _read(task / "stack").splitlines())
    lines.append(_shell(["nvidia-smi", "--query-gpu=utilization.gpu,memory.used,power.draw",
                         "--format=csv"]))
    lines.append(_shell(["sh", "-c", "dmesg 2>&1 | tail -n 15"]))
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--log", type=Path, required=True, help="the command's stdout and stderr")
    p.add_argument("--probe", type=Path, required=True, help="where probes are written")
    p.add_argument("--quiet-s", type=float, default=25.0,
                   help="probe once the log has not grown for this long (again each period)")
    p.add_argument("--limit", type=float, default=600.0, help="seconds before SIGTERM")
    p.add_argument("cmd", nargs=argparse.REMAINDER, help="-- then the command")
    a = p.parse_args(argv)
    cmd = a.cmd[1:] if a.cmd[:1] == ["--"] else a.cmd
    if not cmd:
        p.error("no command given")
    t0 = time.monotonic()
    with open(a.log, "wb") as log:
        child = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
    size, grew, probed = -1, t0, t0
    while child.poll() is None:
        time.sleep(1.0)
        now = time.monotonic()
        if (s := os.path.getsize(a.log)) != size:
            size, grew = s, now
        if now - grew >= a.quiet_s and now - probed >= a.quiet_s:
            probed = now
            with open(a.probe, "a") as f:
                f.write(probe(child.pid, now - grew))
        if now - t0 > a.limit:
            child.send_signal(signal.SIGTERM)
            try:
                child.wait(10)
            except subprocess.TimeoutExpired:
                with open(a.probe, "a") as f:
                    f.write("=== SIGTERM ignored for 10 s\n" + probe(child.pid, now - grew))
                child.kill()
            return 124
    return child.returncode


if __name__ == "__main__":
    sys.exit(main())
