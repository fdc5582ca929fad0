"""How late a stream's end reaches a grpc.aio client after its last token, on one call a
request (the worker front's per-call path), on the CPU.

On an H100 at 64 streams a per-call stream's `complete` reached the gateway 2.7-3.4 ms after
the worker built it, against 0.5 ms for a first token
(service-overhead-7b-gw4-lead-c64-traced-f02af64-h100.json). The worker builds a finishing
stream's last chunk and its `complete` together, then yields them one after the other; the
second write starts once the first one's completes, a turn of an event loop that is delivering
every other stream's token meanwhile. Here a grpc.aio server process does the same
(`--concurrency` calls, one chunk a call every `--step-ms`, each call ending after 48-63 chunks
with its last chunk and a `complete`, both stamped with the moment they were built) and a
client process reads them: the p50 of each message kind's lag from its build to its arrival
(first chunk, later chunks, the last chunk, the `complete`) and of the call's end (the
iterator's stop) after the last build.

    python -m bench.grpc_end_lag --concurrency 16,64 --repeats 3 \\
        --out bench/results/grpc-end-lag-<commit>-cpu.json
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing
import statistics
import sys
import time
from collections.abc import AsyncIterator
from typing import Any

import grpc

from bench.grpc_stream_cost import Steps, serve_ticking
from services.common.processes import free_port
from slora.v1 import inference_pb2 as pb
from slora.v1 import inference_pb2_grpc as pb_grpc

MIN_CHUNKS = 48  # a call's chunks: 48 plus 0-15 (its request id's), so the ends spread
KINDS = ("first", "later", "last_chunk", "complete", "call_end")


def chunks_of(request_id: str) -> int:
    return MIN_CHUNKS + sum(map(ord, request_id)) % 16


def serve(port: int, step_s: float) -> None:
    """The server process: each call's chunks, one a step, until terminated."""

    async def main() -> None:
        steps = Steps(step_s)

        class Ending(pb_grpc.InferenceServiceServicer):
            async def Generate(self, request: pb.GenerateRequest, context: Any
                               ) -> AsyncIterator[pb.GenerateResponse]:
                n = chunks_of(request.request_id)
                for i in range(n):
                    await steps.next()
                    built = repr(time.monotonic())  # the machine's clock: both processes'
                    out = [pb.GenerateResponse(chunk=pb.Chunk(token_ids=[i], text=built))]
                    if i == n - 1:  # as the worker's pump: the last chunk and the end at once
                        out.append(pb.GenerateResponse(complete=pb.Complete(request_id=built)))
                    for response in out:
                        yield response

        await serve_ticking(Ending(), port, steps.tick())

    asyncio.run(main())


async def drive(port: int, streams: int, calls: int) -> dict[str, list[float]]:
    """`calls` calls in turn on each of `streams` concurrent streams; every lag in seconds."""
    lags: dict[str, list[float]] = {k: [] for k in KINDS}
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
        await asyncio.wait_for(channel.channel_ready(), 60)
        stub = pb_grpc.InferenceServiceStub(channel)

        async def one(stream: int) -> None:
            for c in range(calls):
                request_id, got, built = f"{stream}-{c}", [], 0.0
                async for r in stub.Generate(pb.GenerateRequest(request_id=request_id)):
                    now = time.monotonic()
                    if r.HasField("chunk"):
                        built = float(r.chunk.text)
                        got.append(now - built)
                    else:
                        lags["complete"].append(now - float(r.complete.request_id))
                lags["call_end"].append(time.monotonic() - built)
                if len(got) != chunks_of(request_id):
                    raise RuntimeError(f"{request_id}: {len(got)} chunks, expected "
                                       f"{chunks_of(request_id)}")
                lags["first"].append(got[0])
                lags["later"] += got[1:-1]
                lags["last_chunk"].append(got[-1])

        await asyncio.gather(*(one(s) for s in range(streams)))
    return lags


def run_one(streams: int, a: argparse.Namespace) -> dict[str, Any]:
    port = free_port()
    proc = multiprocessing.get_context("spawn").Process(
        target=serve, args=(port, a.step_ms / 1e3), daemon=True)
    proc.start()
    try:
        lags = asyncio.run(drive(port, streams, a.calls))
    finally:
        proc.terminate()
        proc.join(10)
    if len(lags["complete"]) != streams * a.calls:
        raise RuntimeError(f"{len(lags['complete'])} ends, expected {streams * a.calls}")
    return {"concurrency": streams, "calls": streams * a.calls,
            **{f"{k}_p50_ms": statistics.median(v) * 1e3 for k, v in lags.items()}}


def main(argv: list[str] | None = None) -> int:
    from bench.run_record import run_interleaved, run_record  # torch: not in the servers

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--concurrency", default="16,64", help="comma-separated calls in flight")
    ap.add_argument("--calls", type=int, default=3, help="calls in turn on each stream")
    ap.add_argument("--step-ms", type=float, default=10.0)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out", default=None)
    a = ap.parse_args(argv)
    try:
        levels = [int(c) for c in a.concurrency.split(",")]
    except ValueError:
        ap.error(f"--concurrency {a.concurrency!r}: comma-separated integers")
    if not levels or min(levels) < 1 or a.calls < 1 or a.step_ms <= 0 or a.repeats < 1:
        ap.error("--concurrency, --calls and --repeats must be positive, --step-ms > 0")
    result: dict[str, Any] = run_record(["bench.grpc_end_lag", *(argv or sys.argv[1:])])
    result |= {"step_ms": a.step_ms, "grpc": grpc.__version__}
    run_interleaved(a.out, result, levels, a.repeats, lambda c: run_one(c, a),
                    lambda row: (f"{row['concurrency']:4d} streams, repeat {row['repeat']}: "
                                 + ", ".join(f"{k} {row[f'{k}_p50_ms']:.2f}" for k in KINDS)
                                 + " ms p50"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
