"""Child processes of a local stack (`slora up`, the tests): start, wait healthy, stop."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from services.common.tls import open_sync_channel


def free_port() -> int:
    """A TCP port that was free a moment ago on 127.0.0.1."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def slora_argv(*args: str) -> list[str]:
    """The command line that runs `slora ARGS` with this interpreter."""
    return [sys.executable, "-m", "services.cli", *args]


@dataclass
class Child:
    name: str
    argv: list[str]
    popen: subprocess.Popen[bytes]
    log_path: Path

    @property
    def alive(self) -> bool:
        return self.popen.poll() is None

    def log_tail(self, chars: int = 4000) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-chars:]
        except OSError:
            return ""

    def stop(self, timeout_s: float = 15.0) -> int:
        """SIGTERM (graceful drain), then SIGKILL after `timeout_s`; returns the exit code."""
        self.terminate()
        return self.reap(time.monotonic() + timeout_s)

    def terminate(self) -> None:
        """SIGTERM: drain and exit (`reap` waits for it)."""
        if self.alive:
            self.popen.send_signal(signal.SIGTERM)

    def reap(self, deadline: float) -> int:
        """Wait for the exit until monotonic `deadline`, then SIGKILL; the exit code."""
        try:
            return self.popen.wait(max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            self.popen.kill()
        return self.popen.wait()

    def kill(self) -> None:
        """SIGKILL: a crash, no drain."""
        if self.alive:
            self.popen.kill()
        self.popen.wait()


def stop_all(children: Sequence[Child], timeout_s: float = 15.0) -> None:
    """SIGTERM every child at once, then SIGKILL what still runs `timeout_s` later: the
    children drain side by side, so a stack stops within one drain's time, not the sum of
    theirs (three children one after another outlasted the 30 s a bench step gets after its
    limit, and the worker the killed script never reached kept its GPU memory)."""
    for child in children:
        child.terminate()
    deadline = time.monotonic() + timeout_s
    for child in children:
        child.reap(deadline)


def start_child(name: str, argv: Sequence[str], log_dir: Path,
                env: Mapping[str, str] | None = None, cwd: Path | None = None) -> Child:
    """Start `argv` with stdout and stderr appended to log_dir/NAME.log."""
    log_dir.mkdir(parents=True, exist_ok=True)
    log_path = log_dir / f"{name}.log"
    with open(log_path, "ab") as log:
        popen = subprocess.Popen(list(argv), stdout=log, stderr=subprocess.STDOUT,
                                 env={**os.environ, **(env or {})}, cwd=cwd,
                                 start_new_session=True)
    return Child(name, list(argv), popen, log_path)


def is_serving(target: str, service: str = "", timeout_s: float = 1.0) -> bool:
    with open_sync_channel(target) as channel:  # TLS when configured
        try:
            resp = health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(service=service), timeout=timeout_s)
        except grpc.RpcError:
            return False
    return resp.status == health_pb2.HealthCheckResponse.SERVING


def wait_serving(target: str, child: Child | None = None, timeout_s: float = 60.0,
                 service: str = "") -> None:
    """Poll grpc.health.v1 until SERVING; raises RuntimeError (with the child's log) when the
    child exits or the time runs out."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if is_serving(target, service):
            return
        if child is not None and not child.alive:
            raise RuntimeError(f"{child.name} exited with {child.popen.returncode}:\n"
                               f"{child.log_tail()}")
        time.sleep(0.1)
    tail = child.log_tail() if child is not None else ""
    raise RuntimeError(f"{target} not serving after {timeout_s:.0f}s\n{tail}")


def exit_on_sigterm() -> None:
    """SIGTERM raises SystemExit(143) in the main thread, so a bench script's `finally` stops
    the stack it started: its children run in sessions of their own, beyond the killpg of a
    runner whose time limit ran out (a worker left behind holds its GPU memory)."""

    def _exit(_sig: int, _frame: object) -> None:
        raise SystemExit(128 + signal.SIGTERM)

    signal.signal(signal.SIGTERM, _exit)


class StopOnSignal:
    """SIGINT and SIGTERM set a flag instead of raising, from construction on, so a stack that
    is still starting finishes its start and then stops cleanly (`slora up`, `slora serve`)."""

    def __init__(self) -> None:
        self.stopping = False
        signal.signal(signal.SIGTERM, self._set)
        signal.signal(signal.SIGINT, self._set)

    def _set(self, _sig: int, _frame: object) -> None:
        self.stopping = True

    def watch(self, children: Callable[[], Sequence[Child]], say: Callable[[str], None]) -> int:
        """Block until a signal (0) or until one of `children` exits (1, its log said)."""
        while not self.stopping:
            dead = next((c for c in children() if not c.alive), None)
            if dead is not None:
                say(f"{dead.name} exited; stopping. Its log:\n{dead.log_tail()}")
                return 1
            time.sleep(0.5)
        return 0
