"""A gateway as several processes on the same gRPC and HTTP ports (`slora gateway --processes
N`), so forwarding tokens is not bound by one Python process.

The parent reserves the ports (bound with SO_REUSEPORT, never listening, so `:0` resolves to one
port for all) and starts N children (`serve_gateway` with `shared_ports`); the kernel spreads
new connections over the children that listen. Each child has its own routing-table stream
(gateway id `ID-pI`), its own worker channels, evidence and metrics (port METRICS+I). The parent
restarts none: when a child exits on its own, it stops the others and exits 1; SIGTERM/SIGINT
is passed to every child, which drains. A child dies with the parent (PR_SET_PDEATHSIG, and a
parent-pid check), like the worker's engine core.
"""

from __future__ import annotations

import asyncio
import logging
import multiprocessing
import multiprocessing.connection
import os
import signal
import socket
import sys
import tempfile
import time
from dataclasses import replace
from multiprocessing.process import BaseProcess
from pathlib import Path

from services.common.server import bound_address
from services.gateway.http_server import bind
from services.gateway.main import GatewayOptions, serve_gateway
from slora_core.process import die_with_parent

log = logging.getLogger(__name__)
PARENT_CHECK_S = 1.0
STOP_MARGIN_S = 5.0  # past the drain grace, a child still running is killed


def child_options(opts: GatewayOptions, index: int, processes: int, run_dir: Path,
                  ) -> GatewayOptions:
    """What child `index` of `processes` runs with (`opts` has its ports resolved)."""
    sockets = [str(run_dir / f"{i}.sock") for i in range(processes)]
    metrics = opts.metrics_port + index if opts.metrics_port else opts.metrics_port
    return replace(opts, gateway_id=f"{opts.gateway_id}-p{index}", metrics_port=metrics,
                   shared_ports=True, own_socket=sockets[index],
                   sibling_sockets=tuple(s for i, s in enumerate(sockets) if i != index))


def reserve(listen: str) -> tuple[str, socket.socket]:
    """`listen` with its port resolved, and the socket holding it (bound, not listening)."""
    sock = bind(listen, reuse_port=True, backlog=0)
    return bound_address(listen, sock.getsockname()[1]), sock


def serve_processes(opts: GatewayOptions, processes: int) -> int:
    """Run `processes` gateway processes until SIGTERM/SIGINT (0 when every child drained and
    exited cleanly) or until one exits on its own (the others are stopped; 1)."""
    if processes < 2:
        raise ValueError(f"serve_processes runs 2 or more processes, got {processes}")
    listen, grpc_sock = reserve(opts.listen)
    http_listen, http_sock = reserve(opts.http_listen) if opts.http_listen else ("", None)
    opts = replace(opts, listen=listen, http_listen=http_listen)
    stopping: list[int] = []
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda signum, _frame: stopping.append(signum))
    ctx = multiprocessing.get_context("spawn")
    with tempfile.TemporaryDirectory(prefix="slora-gateway-") as run_dir:  # mode 0700
        children: list[BaseProcess] = []
        for i in range(processes):
            child = ctx.Process(target=run_child, name=f"slora-gateway-{i}", args=(
                child_options(opts, i, processes, Path(run_dir)), os.getpid()))
            child.start()
            children.append(child)
        log.info("gateway %s: %d processes on %s%s", opts.gateway_id, processes, listen,
                 f" and HTTP {http_listen}" if http_listen else "")
        try:
            return _supervise(children, stopping, opts.drain_grace_s + STOP_MARGIN_S)
        finally:
            grpc_sock.close()
            if http_sock is not None:
                http_sock.close()


def _supervise(children: list[BaseProcess], stopping: list[int], stop_timeout_s: float) -> int:
    by_sentinel = {c.sentinel: c for c in children}
    while not stopping:
        ready = multiprocessing.connection.wait(list(by_sentinel), timeout=0.5)
        if ready and not stopping:
            # The child whose sentinel fired, not the first that `is_alive()` calls dead: its
            # sentinel can fire before waitpid reaps it, and a search that found none raised
            # here and left the parent joining the live siblings forever.
            dead = by_sentinel[ready[0]]  # type: ignore[index]
            dead.join(timeout=5)
            log.error("gateway process %s exited with %s; stopping the others", dead.name,
                      dead.exitcode)
            _stop_all(children, stop_timeout_s)
            return 1
    _stop_all(children, stop_timeout_s)
    clean = (0, -signal.SIGTERM)  # a child stopped before it installed its handlers
    return 0 if all(c.exitcode in clean for c in children) else 1


def _stop_all(children: list[BaseProcess], timeout_s: float) -> None:
    """SIGTERM to each child still running (they drain), SIGKILL to any left after
    `timeout_s`."""
    for c in children:
        if c.is_alive() and c.pid is not None:
            os.kill(c.pid, signal.SIGTERM)
    deadline = time.monotonic() + timeout_s
    while (alive := [c.sentinel for c in children if c.is_alive()]) and (
            left := deadline - time.monotonic()) > 0:
        multiprocessing.connection.wait(alive, timeout=left)  # returns when any one ends
    for c in (c for c in children if c.is_alive()):
        log.error("gateway process %s still running after %.0f s; killing it", c.name,
                  timeout_s)
        c.kill()
    for c in children:
        c.join()


def run_child(opts: GatewayOptions, parent_pid: int) -> None:
    """Process entry point of one child (spawned by `serve_processes`)."""
    logging.basicConfig(level=os.environ.get("SLORA_LOG_LEVEL", "INFO"),
                        format=f"%(asctime)s gateway {opts.gateway_id} %(levelname)s "
                               "%(name)s: %(message)s")
    # SIGTERM, not SIGKILL: an orphaned child still drains its open streams.
    die_with_parent(parent_pid, signal.SIGTERM)
    sys.exit(asyncio.run(_serve_child(opts, parent_pid)))


async def _serve_child(opts: GatewayOptions, parent_pid: int) -> int:
    watch = asyncio.create_task(_watch_parent(parent_pid))
    try:
        return await serve_gateway(opts)
    finally:
        watch.cancel()


async def _watch_parent(parent_pid: int) -> None:
    """The fallback where PR_SET_PDEATHSIG is unavailable: stop (drain) once orphaned."""
    while os.getppid() == parent_pid:
        await asyncio.sleep(PARENT_CHECK_S)
    log.error("the gateway's supervisor is gone; stopping")
    os.kill(os.getpid(), signal.SIGTERM)


