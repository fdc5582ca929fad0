"""The HTTP API's listening socket: connections accepted from it run without Nagle's algorithm.

asyncio (which uvicorn serves on) sets TCP_NODELAY on a connection only when its socket's proto
is IPPROTO_TCP; a socket made with proto 0 passes that on to every accepted connection, and a
streamed response's small writes then wait for the client's delayed ACKs (~40 ms each time).
"""

from __future__ import annotations

import asyncio
import socket

from services.gateway.http_server import bind


def test_connections_accepted_by_the_http_socket_have_nodelay() -> None:
    async def run() -> int:
        seen: asyncio.Future[int] = asyncio.get_running_loop().create_future()

        async def accepted(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            sock = writer.get_extra_info("socket")
            seen.set_result(sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY))
            writer.close()

        listener = bind("127.0.0.1:0")
        server = await asyncio.start_server(accepted, sock=listener)
        port = listener.getsockname()[1]
        _, writer = await asyncio.open_connection("127.0.0.1", port)
        try:
            return await asyncio.wait_for(seen, 10)
        finally:
            writer.close()
            server.close()
            await server.wait_closed()

    assert asyncio.run(run()) == 1


def test_the_listening_socket_says_tcp() -> None:
    listener = bind("127.0.0.1:0")
    try:
        assert listener.proto == socket.IPPROTO_TCP
        assert listener.type == socket.SOCK_STREAM
    finally:
        listener.close()
