"""A new call's wait behind a step's burst of stream messages, on the CPU: does waking a
step's streams in chunks (a loop turn between chunks) let the worker front take new calls
sooner? (issue 37: at 64 streams the gRPC hops, not the core, hold the added TTFT).

A grpc.aio server process plays the worker front's delivery: every `--step-ms` a stepper
task wakes the streams waiting for a first token (a loop turn of their own, as
`CoreClient._deliver` does), then every running stream, each of which yields one
GenerateResponse (the front's way). Variants (`--chunks`): `all` wakes the running streams
at once (the front today); a number N wakes N, yields the loop a turn (`asyncio.sleep(0)`,
where the loop polls its sockets: grpc's completions, new calls among them), and goes on.

Two client processes: one keeps `--concurrency` streams reading; a prober opens new calls
at `--probe-rate` a second (Poisson). A probe call is answered with one message at the next
step. Per probe, on the shared monotonic clock: the way in (the probe's send to its
handler's entry) and the way back (the step that woke it to its message read by the
client). Per run: the server's CPU per load message (/proc), and load messages a second.

    python -m bench.front_burst --out bench/results/front-burst-<commit>-cpu.json
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing
import os
import random
import sys
import time
from collections.abc import AsyncIterator
from typing import Any

import grpc
import numpy as np

from bench.grpc_stream_cost import cpu_s, serve_ticking
from services.common.processes import free_port
from slora.v1 import inference_pb2 as pb
from slora.v1 import inference_pb2_grpc as pb_grpc

LOAD = pb.GenerateResponse(chunk=pb.Chunk(token_ids=[7], text=" tok"))


def serve(port: int, step_s: float, chunk: int) -> None:
    """The server process until terminated; `chunk` 0 wakes every running stream at once."""

    async def main() -> None:
        running: list[asyncio.Event] = []
        waiting: list[tuple[asyncio.Event, list[int]]] = []  # probes: (event, [step ns])

        async def stepper() -> None:
            loop = asyncio.get_running_loop()
            due = loop.time()
            while True:  # on a fixed schedule, however long a step's waking took
                due += step_s
                await asyncio.sleep(max(0.0, due - loop.time()))
                now = time.monotonic_ns()
                first, waiting[:] = list(waiting), []
                for event, woke in first:
                    woke.append(now)
                    event.set()
                if first:
                    await asyncio.sleep(0)  # the first tokens' turn (CoreClient._deliver)
                for i, event in enumerate(list(running)):
                    event.set()
                    if chunk and (i + 1) % chunk == 0:
                        await asyncio.sleep(0)

        class Front(pb_grpc.InferenceServiceServicer):
            async def Generate(self, request: pb.GenerateRequest, context: Any
                               ) -> AsyncIterator[pb.GenerateResponse]:
                entry = time.monotonic_ns()
                event = asyncio.Event()
                if request.request_id == "probe":
                    woke: list[int] = []
                    waiting.append((event, woke))
                    await event.wait()
                    yield pb.GenerateResponse(chunk=pb.Chunk(text=f"{entry},{woke[0]}"))
                    return
                running.append(event)
                try:
                    while True:
                        await event.wait()
                        event.clear()
                        yield LOAD
                finally:
                    running.remove(event)

        await serve_ticking(Front(), port, stepper())

    asyncio.run(main())


def load(port: int, streams: int, seconds: float, counts: Any) -> None:
    """The load client process: `streams` streams read for `seconds`; their message count
    into `counts[0]`."""

    async def main() -> int:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            stub = pb_grpc.InferenceServiceStub(channel)
            got = [0]

            async def one() -> None:
                async for _ in stub.Generate(pb.GenerateRequest(request_id="load")):
                    got[0] += 1

            tasks = [asyncio.create_task(one()) for _ in range(streams)]
            await asyncio.sleep(seconds)
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            return got[0]

    counts[0] = asyncio.run(main())


async def probe(port: int, rate: float, seconds: float, settle_s: float
                ) -> list[tuple[int, int, int]]:
    """New calls at `rate` a second for `seconds` (those in the first `settle_s` dropped);
    per call in ns: send to handler entry, the step that woke it to its message read, send
    to read."""
    rows: list[tuple[int, int, int]] = []
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
        stub = pb_grpc.InferenceServiceStub(channel)
        start = time.monotonic()

        async def one() -> None:
            sent = time.monotonic_ns()
            async for r in stub.Generate(pb.GenerateRequest(request_id="probe")):
                read = time.monotonic_ns()
                entry, woke = map(int, r.chunk.text.split(","))
                if time.monotonic() - start > settle_s:
                    rows.append((entry - sent, read - woke, read - sent))

        tasks = []
        while time.monotonic() - start < seconds:
            await asyncio.sleep(random.expovariate(rate))
            tasks.append(asyncio.create_task(one()))
        await asyncio.gather(*tasks)
    return rows


def run_one(chunk: int, a: argparse.Namespace) -> dict[str, Any]:
    port = free_port()
    ctx = multiprocessing.get_context("spawn")
    server = ctx.Process(target=serve, args=(port, a.step_ms / 1e3, chunk), daemon=True)
    server.start()
    counts = ctx.Array("q", 1)
    try:
        assert server.pid is not None
        asyncio.run(wait_ready(port))
        loader = ctx.Process(target=load, args=(port, a.concurrency, a.seconds + 1, counts))
        loader.start()
        time.sleep(1)  # the load streams running
        before, t0 = cpu_s(server.pid), time.perf_counter()
        rows = asyncio.run(probe(port, a.probe_rate, a.seconds, a.settle_s))
        used, wall = cpu_s(server.pid) - before, time.perf_counter() - t0
        loader.join(30)
    finally:
        server.terminate()
        server.join(10)
    way_in, way_back, total = (np.array([r[i] for r in rows]) / 1e6 for i in range(3))
    rate = counts[0] / (a.seconds + 1)  # the load streams' messages a second
    # The server's CPU over the probing, per load message then (the probes' own work, a few
    # percent of the messages, counted in).
    return {"chunk": chunk or "all", "probes": len(rows), "load_messages": counts[0],
            "load_messages_per_s": rate, "server_busy": used / wall,
            "server_cpu_us_per_message": used / max(1.0, rate * wall) * 1e6,
            **{f"{name}_ms": {"p50": float(np.percentile(v, 50)),
                              "p90": float(np.percentile(v, 90)), "mean": float(v.mean())}
               for name, v in (("way_in", way_in), ("way_back", way_back),
                               ("probe_total", total))}}


async def wait_ready(port: int) -> None:
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
        await asyncio.wait_for(channel.channel_ready(), 60)


def main(argv: list[str] | None = None) -> int:
    # Here, not at the top: the child processes import this module, and run_record imports
    # torch (seconds a process) for the hardware line.
    from bench.run_record import run_interleaved, run_record

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--concurrency", type=int, default=64, help="running streams")
    ap.add_argument("--step-ms", type=float, default=9.0,
                    help="a decode step (64 streams of Llama-2-7B on an H100: about 9 ms)")
    ap.add_argument("--chunks", default="all,16,8,4",
                    help="running streams woken between loop turns ('all': at once)")
    ap.add_argument("--probe-rate", type=float, default=100.0, help="new calls a second")
    ap.add_argument("--seconds", type=float, default=8.0, help="probing, a run")
    ap.add_argument("--settle-s", type=float, default=1.0, help="probes not counted first")
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--out", default=None)
    a = ap.parse_args(argv)
    try:
        chunks = [0 if c == "all" else int(c) for c in a.chunks.split(",") if c]
    except ValueError:
        ap.error(f"--chunks {a.chunks!r}: 'all' or positive counts, comma-separated")
    if not chunks or any(c < 0 for c in chunks):
        ap.error(f"--chunks {a.chunks!r}: 'all' or positive counts, comma-separated")
    if (a.concurrency < 1 or a.step_ms <= 0 or a.probe_rate <= 0 or a.repeats < 1
            or a.seconds <= a.settle_s):
        ap.error("--concurrency, --step-ms, --probe-rate and --repeats must be positive, "
                 "--seconds more than --settle-s")
    result: dict[str, Any] = run_record(["bench.front_burst", *(argv or sys.argv[1:])])
    result |= {"concurrency": a.concurrency, "step_ms": a.step_ms, "probe_rate": a.probe_rate,
               "seconds": a.seconds, "cpus": os.cpu_count(), "grpc": grpc.__version__}
    run_interleaved(a.out, result, chunks, a.repeats, lambda chunk: run_one(chunk, a),
                    lambda row: (
                        f"chunk {row['chunk']!s:4s} repeat {row['repeat']}: way in p50 "
                        f"{row['way_in_ms']['p50']:.2f} p90 {row['way_in_ms']['p90']:.2f} ms, "
                        f"way back p50 {row['way_back_ms']['p50']:.2f} p90 "
                        f"{row['way_back_ms']['p90']:.2f} ms, "
                        f"{row['load_messages_per_s']:.0f} msg/s, server busy "
                        f"{row['server_busy']:.0%}"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
