"""One entry point for the benchmarks and GPU checks: `python -m bench SUITE [SUITE ...]`.

Suites are named for what they measure (bench/suites.py; `--list` prints them). Each step runs
as its own process under its own time limit, and all under one deadline (--budget-s from the
start; a step that would not fit is skipped and logged). Each step's output goes to
OUT/<step>.log, one line per step to OUT/steps.log, and OUT/run.json records the commit, the
command, the hardware and each step's exit status and seconds. Run from the repository root:

    python -m bench --list
    SLORA_COMMIT=$(git rev-parse HEAD) python -m bench lora-grid adapter-vs-base --out /tmp/out
    python -m bench round --wheels .whl --pack --budget-s 560   # 2 H200s, one device call

On the device (a copy without .git) export SLORA_COMMIT; --wheels installs the carried wheels of
what the image lacks; --pack leaves OUT/round.tgz and steps.log only (the device returns a few
files).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import shlex
import signal
import subprocess
import sys
import tarfile
import threading
import time
from pathlib import Path
from typing import Any

from bench.run_record import commit_id
from bench.suites import SUITES, Step

GRACE_S = 30  # after the limit's signal, SIGKILL (NCCL can keep a process from dying; a
#               script's `finally` stops the stack it started, each child draining)
STEP_ENV = "SLORA_BENCH_STEP"  # marks every process a step starts (its children inherit it)


def leftovers(marker: str) -> list[int]:
    """The live processes whose environment holds STEP_ENV=`marker`: what a step left behind
    when it ended. A stack's children run in sessions of their own, so the killpg at a step's
    limit misses them, and a script killed in its `finally` (the stack draining child by
    child) leaves them serving, holding their GPU memory: the next step's engine then runs out
    of memory (a worker core kept 32 GiB of an H100 at 9c7f623)."""
    needle = f"{STEP_ENV}={marker}".encode()
    found = []
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit() or int(proc.name) == os.getpid():
            continue
        try:
            environ = (proc / "environ").read_bytes()
        except OSError:  # gone meanwhile, or another user's
            continue
        if needle in environ.split(b"\0"):
            found.append(int(proc.name))
    return found


def kill_leftovers(marker: str, wait_s: float = 10.0) -> list[int]:
    """SIGKILL what `leftovers` finds and wait (up to `wait_s`) until they are gone, their GPU
    memory with them; returns their pids."""
    pids = leftovers(marker)
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):  # gone meanwhile
            os.kill(pid, signal.SIGKILL)
    deadline = time.monotonic() + wait_s
    while pids and time.monotonic() < deadline and leftovers(marker):
        time.sleep(0.1)  # a zombie's environ reads empty: gone, its memory freed
    return pids


class Runner:
    def __init__(self, out: Path, budget_s: float, skip: set[str], limits: dict[str, int],
                 extra: dict[str, list[str]], env: dict[str, str]) -> None:
        self.out, self.skip, self.limits, self.extra, self.env = out, skip, limits, extra, env
        self.deadline = time.monotonic() + budget_s
        # What a step's arguments name: OUT, and the commit and card of its result files.
        self.names = {"{out}": str(out), "{card}": card(gpus()),
                      "{commit}": env.get("SLORA_COMMIT", "")[:7] or "unknown"}
        self.records: list[dict[str, Any]] = []
        self._lock = threading.Lock()

    def log(self, line: str) -> None:
        with self._lock, open(self.out / "steps.log", "a") as f:
            f.write(line + "\n")
        print(line, flush=True)

    def argv(self, s: Step) -> list[str]:
        args = [fill(a, self.names) for a in s.argv]
        return [sys.executable, "-m", *args, *self.extra.get(s.name, [])]

    def run(self, s: Step) -> None:
        left = int(self.deadline - time.monotonic() - 15)
        if s.name in self.skip:
            self.log(f"{s.name} skipped: named in --skip")
            return
        if left < 30:
            self.log(f"{s.name} skipped: {left}s left before the deadline")
            return
        limit = min(self.limits.get(s.name, s.limit_s), left)
        argv = self.argv(s)
        t0 = time.monotonic()
        marker = f"{s.name}.{os.getpid()}"
        with open(self.out / f"{s.name}.log", "wb") as log:
            proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT,
                                    env=self.env | dict(s.env) | {STEP_ENV: marker},
                                    start_new_session=True)
            try:
                rc = proc.wait(limit)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, getattr(signal, f"SIG{s.stop_signal}"))
                try:
                    proc.wait(GRACE_S)
                except subprocess.TimeoutExpired:
                    os.killpg(proc.pid, signal.SIGKILL)
                    proc.wait()
                rc = 124
        stray = kill_leftovers(marker)
        if stray:
            self.log(f"{s.name} left {len(stray)} processes running; killed {stray}")
        took = time.monotonic() - t0
        with self._lock:
            self.records.append({"step": s.name, "rc": rc, "limit_s": limit,
                                 "seconds": round(took, 1), "command": shlex.join(argv[1:]),
                                 "env": dict(s.env)})
        self.log(f"{s.name} rc={rc} limit={limit}s took={took:.0f}s")

    def run_lane(self, steps: list[Step]) -> None:
        for s in steps:
            self.run(s)

    def run_suite(self, steps: tuple[Step, ...]) -> None:
        """Steps without a lane one after another, then the lanes side by side."""
        for s in steps:
            if s.lane is None:
                self.run(s)
        lanes: dict[int, list[Step]] = {}
        for s in steps:
            if s.lane is not None:
                lanes.setdefault(s.lane, []).append(s)
        threads = [threading.Thread(target=self.run_lane, args=(ss,)) for ss in lanes.values()]
        for t in threads:
            t.start()
        for t in threads:
            t.join()


def gpus() -> list[str]:
    try:
        res = subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version",
                              "--format=csv,noheader"], capture_output=True, text=True,
                             timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return []
    return [line.strip() for line in res.stdout.splitlines() if line.strip()]


def card(names: list[str]) -> str:
    """The first GPU's short name for result files ("NVIDIA H200, 570.x" -> h200), cpu
    without one."""
    if not names:
        return "cpu"
    model = names[0].split(",")[0].removeprefix("NVIDIA").strip().lower()
    for known in ("h200", "h100", "a100", "l40s"):
        if known in model:
            return known
    return "-".join(model.split()) or "gpu"


def fill(arg: str, names: dict[str, str]) -> str:
    for key, value in names.items():
        arg = arg.replace(key, value)
    return arg


def install_wheels(folder: Path, out: Path) -> str:
    """The carried wheels into /tmp/site (the device image lacks them); returns the path.
    `--upgrade` replaces what an earlier call left there on a warm machine (without it pip
    keeps the old version: a grpcio older than the generated code's refused to import)."""
    site = "/tmp/site"
    with open(out / "pip.log", "wb") as log:
        subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps",
                        "--no-compile", "--upgrade", "--target", site,
                        *map(str, folder.glob("*.whl"))],
                       stdout=log, stderr=subprocess.STDOUT, check=True)
    return site


def pack(out: Path) -> None:
    """Everything under OUT into OUT/round.tgz; only it and steps.log stay loose."""
    tmp = out.parent / f".{out.name}.tgz"
    with tarfile.open(tmp, "w:gz") as tar:
        for f in sorted(out.rglob("*")):
            if f.is_file():
                tar.add(f, arcname=str(f.relative_to(out)))
    for f in sorted(out.rglob("*"), reverse=True):
        if f.name != "steps.log":
            f.unlink() if f.is_file() else f.rmdir()
    tmp.rename(out / "round.tgz")


def pairs(values: list[str], what: str) -> dict[str, str]:
    out = {}
    for v in values:
        name, sep, rest = v.partition("=")
        if not sep:
            raise SystemExit(f"{what} takes STEP=VALUE, got {v!r}")
        out[name] = rest
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench", description=__doc__.split("\n")[0])
    p.add_argument("suites", nargs="*", help="suites, run in this order")
    p.add_argument("--list", action="store_true", help="print the suites and their steps")
    p.add_argument("--out", default=os.environ.get("OUT", "/tmp/bench-out"))
    p.add_argument("--budget-s", type=float, default=3600.0,
                   help="deadline from the start: a step that would not fit is skipped")
    p.add_argument("--skip", default="", help="step names to leave out, comma-separated")
    p.add_argument("--limit", action="append", default=[], metavar="STEP=S",
                   help="another time limit for a step")
    p.add_argument("--extra", action="append", default=[], metavar="STEP=ARGS",
                   help="arguments appended to a step's command (later flags win)")
    p.add_argument("--wheels", default=None, help="folder of wheels to install first")
    p.add_argument("--pack", action="store_true", help="pack OUT into OUT/round.tgz")
    a = p.parse_args(argv)
    if a.list or not a.suites:
        for name, steps in SUITES.items():
            print(f"{name}: " + "; ".join(
                f"{s.name} ({s.limit_s}s{'' if s.lane is None else f', lane {s.lane}'})"
                for s in steps))
        return 0
    unknown = [s for s in a.suites if s not in SUITES]
    if unknown:
        p.error(f"no suite {', '.join(unknown)} (python -m bench --list)")
    out = Path(a.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    paths = [os.getcwd()]
    if a.wheels:
        paths.append(install_wheels(Path(a.wheels), out))
    paths.append(os.environ.get("PYTHONPATH", ""))
    env = os.environ | {"PYTHONPATH": os.pathsep.join(filter(None, paths)),
                        "PYTHONUNBUFFERED": "1", "SLORA_COMMIT": commit_id()}
    env.setdefault("TRITON_INTERPRET", "0")
    runner = Runner(out, a.budget_s, set(filter(None, a.skip.split(","))),
                    {k: int(v) for k, v in pairs(a.limit, "--limit").items()},
                    {k: shlex.split(v) for k, v in pairs(a.extra, "--extra").items()}, env)
    for name in a.suites:
        runner.run_suite(SUITES[name])
    record = {"commit": env["SLORA_COMMIT"],
              "command": shlex.join(["python", "-m", "bench", *(argv or sys.argv[1:])]),
              "gpus": gpus(), "host": platform.node(), "python": platform.python_version(),
              "steps": runner.records}
    (out / "run.json").write_text(json.dumps(record, indent=1))
    if a.pack:
        pack(out)
    return 0 if all(r["rc"] == 0 for r in runner.records) else 1


if __name__ == "__main__":
    sys.exit(main())
