"""What one streamed gRPC message costs a Python server's CPU: the floor under the worker
front's and the gateway's per-token work (issue 37's service-path TTFT).

A server process streams `--messages` GenerateResponse chunks on each of `--concurrency`
concurrent Generate calls, one per call every `--step-ms` (as an engine step wakes every
stream), to clients in this process. Servers, one after another, the same load each:
- `aio_yield`: grpc.aio, the servicer an async generator (the worker front's and the
  gateway's way);
- `aio_write`: grpc.aio, `await context.write(...)`;
- `sync`: grpc's thread-pool server, the servicer a generator, a thread a stream.
For each: the server process's CPU seconds (user + system, /proc/<pid>/stat) per message and
its busy fraction.

    python -m bench.grpc_stream_cost --out bench/results/grpc-stream-cost-cpu.json
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing
import os
import sys
import threading
import time
from collections.abc import AsyncIterator, Coroutine, Iterator
from concurrent import futures
from typing import Any

import grpc

from services.common.processes import free_port
from slora.v1 import inference_pb2 as pb
from slora.v1 import inference_pb2_grpc as pb_grpc

SERVERS = ("aio_yield", "aio_write", "sync")


def message(i: int) -> pb.GenerateResponse:
    return pb.GenerateResponse(chunk=pb.Chunk(token_ids=[i], text=" tok"))


def serve(kind: str, port: int, messages: int, step_s: float, streams: int) -> None:
    """The server process: `kind`'s servicer, until terminated."""
    if kind == "sync":
        tick = threading.Condition()
        steps = [0]

        def ticker() -> None:
            while True:
                time.sleep(step_s)
                with tick:
                    steps[0] += 1
                    tick.notify_all()

        class Sync(pb_grpc.InferenceServiceServicer):
            def Generate(self, request: pb.GenerateRequest, context: Any
                         ) -> Iterator[pb.GenerateResponse]:
                seen = steps[0]
                for i in range(messages):
                    with tick:
                        while steps[0] == seen:
                            tick.wait()
                        seen = steps[0]
                    yield message(i)

        threading.Thread(target=ticker, daemon=True).start()
        server = grpc.server(futures.ThreadPoolExecutor(max_workers=streams + 8))
        pb_grpc.add_InferenceServiceServicer_to_server(Sync(), server)
        server.add_insecure_port(f"127.0.0.1:{port}")
        server.start()
        server.wait_for_termination()
        return

    async def main() -> None:
        steps = Steps(step_s)

        class Yield(pb_grpc.InferenceServiceServicer):
            async def Generate(self, request: pb.GenerateRequest, context: Any
                               ) -> AsyncIterator[pb.GenerateResponse]:
                for i in range(messages):
                    await steps.next()
                    yield message(i)

        class Write(pb_grpc.InferenceServiceServicer):
            async def Generate(self, request: pb.GenerateRequest, context: Any) -> None:
                for i in range(messages):
                    await steps.next()
                    await context.write(message(i))

        await serve_ticking(Yield() if kind == "aio_yield" else Write(), port, steps.tick())

    asyncio.run(main())


class Steps:
    """An engine's steps for a test server: `next()` returns at the next of `tick()`'s ticks,
    every `step_s` (run beside the server)."""

    def __init__(self, step_s: float) -> None:
        self.step_s = step_s
        self._event = asyncio.Event()

    async def tick(self) -> None:
        while True:
            await asyncio.sleep(self.step_s)
            self._event.set()
            self._event = asyncio.Event()

    async def next(self) -> None:
        await self._event.wait()


async def serve_ticking(servicer: pb_grpc.InferenceServiceServicer, port: int,
                        ticker: Coroutine[Any, Any, None]) -> None:
    """`servicer` on a grpc.aio server at 127.0.0.1:`port` until terminated, `ticker` (the
    engine's steps) running beside it."""
    ticking = asyncio.get_running_loop().create_task(ticker)
    server = grpc.aio.server()
    pb_grpc.add_InferenceServiceServicer_to_server(servicer, server)
    server.add_insecure_port(f"127.0.0.1:{port}")
    await server.start()
    try:
        await server.wait_for_termination()
    finally:
        ticking.cancel()


def cpu_s(pid: int) -> float:
    """User + system CPU seconds of process `pid` so far."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


async def drive(port: int, streams: int, pid: int) -> tuple[float, int, float]:
    """Every stream's messages read to the end, once the server answers a first call (its
    start-up not counted); (seconds, messages, the server's CPU seconds meanwhile)."""
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
        await asyncio.wait_for(channel.channel_ready(), 60)
        stub = pb_grpc.InferenceServiceStub(channel)

        async def one() -> int:
            return sum([1 async for _ in stub.Generate(pb.GenerateRequest())])

        await one()  # warm: the server's first call imports and builds what it needs
        before = cpu_s(pid)
        t0 = time.perf_counter()
        counts = await asyncio.gather(*(one() for _ in range(streams)))
        return time.perf_counter() - t0, sum(counts), cpu_s(pid) - before


def run_one(kind: str, a: argparse.Namespace) -> dict[str, Any]:
    port = free_port()
    ctx = multiprocessing.get_context("spawn")
    proc = ctx.Process(target=serve, args=(kind, port, a.messages, a.step_ms / 1e3,
                                           a.concurrency), daemon=True)
    proc.start()
    try:
        assert proc.pid is not None
        wall, got, used = asyncio.run(drive(port, a.concurrency, proc.pid))
    finally:
        proc.terminate()
        proc.join(10)
    if got != a.messages * a.concurrency:
        raise RuntimeError(f"{kind}: {got} messages, expected {a.messages * a.concurrency}")
    return {"server": kind, "messages": got, "wall_s": wall, "server_cpu_s": used,
            "server_cpu_us_per_message": used / got * 1e6, "server_busy": used / wall}


def main(argv: list[str] | None = None) -> int:
    # Here, not at the top: the server processes import this module, and run_record imports
    # torch (seconds a process) for the hardware line.
    from bench.run_record import run_interleaved, run_record

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--concurrency", type=int, default=64)
    ap.add_argument("--messages", type=int, default=200, help="messages a stream")
    ap.add_argument("--step-ms", type=float, default=10.0)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--servers", default=",".join(SERVERS))
    ap.add_argument("--out", default=None)
    a = ap.parse_args(argv)
    kinds = [k for k in a.servers.split(",") if k]
    if not kinds or any(k not in SERVERS for k in kinds):
        ap.error(f"--servers {a.servers!r}: choose from {', '.join(SERVERS)}")
    if a.concurrency < 1 or a.messages < 1 or a.step_ms <= 0 or a.repeats < 1:
        ap.error("--concurrency, --messages and --repeats must be positive, --step-ms > 0")
    result: dict[str, Any] = run_record(["bench.grpc_stream_cost", *(argv or sys.argv[1:])])
    result |= {"concurrency": a.concurrency, "messages_per_stream": a.messages,
               "step_ms": a.step_ms, "cpus": os.cpu_count(), "grpc": grpc.__version__}
    run_interleaved(a.out, result, kinds, a.repeats, lambda kind: run_one(kind, a),
                    lambda row: (f"{row['server']:10s} repeat {row['repeat']}: "
                                 f"{row['server_cpu_us_per_message']:.1f} us a message, "
                                 f"server busy {row['server_busy']:.0%}"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
