"""Starting a grpc.aio server with health and reflection, and stopping it gracefully."""

from __future__ import annotations

import asyncio
import logging
import signal
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from services.common.tls import TlsConfig, add_port
from services.common.wire import DecodeErrorInterceptor

log = logging.getLogger(__name__)

SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING
# Long-lived streams (placement, routing) hold connections open; keepalives let both ends notice
# a dead peer within seconds instead of TCP's minutes.
CHANNEL_OPTIONS: tuple[tuple[str, int], ...] = (
    ("grpc.keepalive_time_ms", 10_000),
    ("grpc.keepalive_timeout_ms", 5_000),
    ("grpc.keepalive_permit_without_calls", 1),
    ("grpc.http2.max_pings_without_data", 0),
)
SERVER_OPTIONS: tuple[tuple[str, int], ...] = (
    *CHANNEL_OPTIONS,
    ("grpc.http2.min_ping_interval_without_data_ms", 5_000),
    ("grpc.so_reuseport", 0),
)


@dataclass
class GrpcServer:
    """A started server: `port` is the bound port (useful with `:0`)."""

    server: grpc.aio.Server
    health: health.aio.HealthServicer
    services: tuple[str, ...]
    port: int

    async def set_serving(self, serving: bool) -> None:
        """Liveness (`""`) and readiness of every service follow `serving`."""
        status = SERVING if serving else NOT_SERVING
        for name in ("", *self.services):
            await self.health.set(name, status)


async def start_server(listen: str, add_services: Callable[[grpc.aio.Server], None],
                       service_names: Sequence[str], *, serving: bool = True,
                       interceptors: Sequence[grpc.aio.ServerInterceptor] = (),
                       reuse_port: bool = False) -> GrpcServer:
    """Bind `listen` (host:port), add the services, health and reflection, and start.

    `interceptors` run in order, before the one that refuses undecodable requests with
    INVALID_ARGUMENT (installed on every server). `reuse_port` shares the port with the other
    processes of one service that set it too (SO_REUSEPORT: the kernel spreads connections);
    off, a port already taken fails the start. Raises RuntimeError when the address cannot
    be bound."""
    options = tuple((k, int(reuse_port)) if k == "grpc.so_reuseport" else (k, v)
                    for k, v in SERVER_OPTIONS)
    server = grpc.aio.server(options=options,
                             interceptors=[*interceptors, DecodeErrorInterceptor()])
    add_services(server)
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    names = (*service_names, health.SERVICE_NAME, reflection.SERVICE_NAME)
    reflection.enable_server_reflection(names, server)
    port = add_port(server, listen, TlsConfig.from_env())  # TLS when configured (tls.py)
    if port == 0:
        raise RuntimeError(f"cannot bind {listen}")
    await server.start()
    handle = GrpcServer(server, health_servicer, tuple(service_names), port)
    await handle.set_serving(serving)
    return handle


def bound_address(listen: str, port: int) -> str:
    """`listen` with its port replaced by the bound one (`[::]:0` -> `[::]:43121`)."""
    host = listen.rsplit(":", 1)[0]
    return f"{host}:{port}"


def is_grpc_poller_wakeup(context: dict[str, Any]) -> bool:
    """True for grpc.aio's spurious poller wakeup: its completion-queue poller reads a wakeup
    socket whenever the loop reports it readable, and a read that finds nothing raises
    BlockingIOError (EAGAIN), which asyncio reports as "Exception in callback
    PollerCompletionQueue._handle_events" at ERROR. Nothing is lost: the reader stays
    registered and the next wakeup is read (the fault is grpc's; it came up in a control-plane
    restart test in one CI run of many)."""
    return (isinstance(context.get("exception"), BlockingIOError)
            and "PollerCompletionQueue._handle_events" in repr(context.get("handle")))


def quiet_grpc_poller_wakeups() -> None:
    """On the running loop, log grpc's spurious poller wakeups (is_grpc_poller_wakeup) at DEBUG
    and pass every other loop exception to the handler that was there (asyncio's default
    when none). Installing it twice on one loop changes nothing."""
    loop = asyncio.get_running_loop()
    before = loop.get_exception_handler()
    if getattr(before, "quiets_grpc_poller", False):
        return

    def handle(loop: asyncio.AbstractEventLoop, context: dict[str, Any]) -> None:
        if is_grpc_poller_wakeup(context):
            log.debug("grpc poller woke with nothing to read (ignored)")
        elif before is not None:
            before(loop, context)
        else:
            loop.default_exception_handler(context)

    handle.quiets_grpc_poller = True  # type: ignore[attr-defined]
    loop.set_exception_handler(handle)


def install_stop_handlers(on_stop: Callable[[], None]) -> None:
    """Call `on_stop` (on the running loop) at the first SIGTERM or SIGINT."""
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, on_stop)


async def drain_and_stop(handle: GrpcServer, wait_idle: Callable[[], Awaitable[None]],
                         grace_s: float) -> None:
    """Graceful shutdown: health NOT_SERVING first (balancers stop sending), wait until the
    in-flight work is done (at most `grace_s`), then stop the server."""
    await handle.set_serving(False)
    try:
        await asyncio.wait_for(wait_idle(), timeout=grace_s)
    except TimeoutError:
        log.warning("drain: still busy after %.1fs, stopping anyway", grace_s)
    await handle.server.stop(grace=1.0)
