"""uvicorn serving the HTTP API inside the gateway's own event loop (next to its gRPC server)."""

from __future__ import annotations

import asyncio
import contextlib
import socket
from collections.abc import Iterator

import uvicorn

from services.common.tls import TlsConfig
from services.gateway.http_api import HttpApi


class _Server(uvicorn.Server):
    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        # The gateway's own handlers drain gRPC and HTTP together; uvicorn must not take them.
        yield


class HttpServer:
    def __init__(self, server: _Server, task: asyncio.Task[None], port: int) -> None:
        self.server, self.task, self.port = server, task, port

    async def stop(self) -> None:
        """Stop accepting, let open responses finish (the caller drained the calls first)."""
        self.server.should_exit = True
        await self.task


def bind(listen: str, reuse_port: bool = False, backlog: int = 1024) -> socket.socket:
    """A listening socket on host:port ('[::]' or a host name allowed). RuntimeError if taken
    (with `reuse_port`: taken by a socket that did not set SO_REUSEPORT too). `backlog` 0
    binds without listening (a port reserved, no connection comes to it)."""
    host, _, port = listen.rpartition(":")
    host = host.strip("[]") or "0.0.0.0"
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    # IPPROTO_TCP named, not 0: asyncio turns Nagle off (TCP_NODELAY) only on sockets whose
    # proto says TCP, and accepted connections inherit it. With proto 0 every response's
    # second small write (the first SSE event after the headers) waited for the client's
    # delayed ACK, ~40 ms (bench.service_overhead, HTTP against gRPC through one gateway).
    sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    if reuse_port:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    try:
        sock.bind((host, int(port)))
    except OSError as exc:
        sock.close()
        raise RuntimeError(f"cannot bind the HTTP API to {listen}: {exc}") from None
    if backlog:
        sock.listen(backlog)
        sock.setblocking(False)
    return sock


async def start_http(listen: str, api: HttpApi, reuse_port: bool = False) -> HttpServer:
    """Serve `api` on `listen` until `stop()`; returns once the socket accepts connections."""
    sock = bind(listen, reuse_port)
    tls = TlsConfig.from_env()  # HTTPS with the process's certificate, like its gRPC port
    https = tls is not None and tls.serves_tls
    config = uvicorn.Config(api.app(), log_level="warning", lifespan="off",
                            timeout_graceful_shutdown=5, access_log=False,
                            ssl_certfile=str(tls.cert) if https and tls else None,
                            ssl_keyfile=str(tls.key) if https and tls else None)
    server = _Server(config)
    task = asyncio.create_task(server.serve(sockets=[sock]))
    while not server.started:
        if task.done():
            task.result()
            raise RuntimeError(f"the HTTP API on {listen} did not start")
        await asyncio.sleep(0.01)
    return HttpServer(server, task, sock.getsockname()[1])
