"""The gateway hop alone, on the CPU: a fake worker behind a real gateway, and the gateway
process's CPU time per token it forwards, over each gateway -> worker path (`--upstreams`:
GenerateMux and one Generate call a request, side by side).

    python -m bench.gateway_hop --concurrency 64,256 --repeats 3 \
        --out bench/results/gateway-hop-cpu.json

The fake worker is a real grpc.aio `InferenceService` server (its own process, the gateway-token
interceptor every worker has) that streams like an engine at batch B: every `--step-ms` each
running stream gets one token, until its `max_new_tokens`. A stand-in control plane (its own
process) serves `WatchRouting` with a snapshot naming that worker and one tenant key; the
gateway is the real `slora gateway` process (one per variant and upstream path). Three paths,
interleaved per repeat: client -> worker (the gateway token presented), client -> gateway
(gRPC), client -> gateway (HTTP SSE).
Clients are bench.service_overhead's, in several processes. For each run: delivered tokens/s,
TTFT (from the run's start, as service_overhead counts it), the CPU seconds (user + system,
from /proc/<pid>/stat) the gateway and the worker spent per 1,000 tokens delivered, and the
closed loop's hand-over lag (`FakeWorker`: from the step that gave a stream its last token to
its successor's arrival at the worker, what the engine's late-admission window must catch).
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import json
import multiprocessing
import os
import sys
import tempfile
from collections import deque
from collections.abc import AsyncGenerator, AsyncIterator
from dataclasses import dataclass
from functools import partial
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

import grpc
import numpy as np

from bench.grpc_stream_cost import cpu_s
from services.commands.gateway import MUX_FROM_DEFAULT, UPSTREAM_ENV
from services.common.cluster_token import CLUSTER_TOKEN_ENV
from services.common.hop_auth import GATEWAY_HEADER, GATEWAY_TOKEN_ENV, GatewayOnlyInterceptor
from services.common.processes import (
    Child,
    exit_on_sigterm,
    free_port,
    slora_argv,
    start_child,
    wait_serving,
)
from services.common.server import start_server
from services.worker.mux import MuxSession
from slora.v1 import inference_pb2 as pb
from slora.v1 import inference_pb2_grpc as pb_grpc
from slora.v1 import placement_pb2 as ppb
from slora.v1 import placement_pb2_grpc as ppb_grpc

BASE_MODEL = "demo"  # the `model` bench.service_overhead's HTTP client sends for no adapter
WORKER_ID = "fake-worker-0"
GATEWAY_TOKEN = "slg_bench_gateway_hop"
TENANT_KEY = "slk_bench_gateway_hop"


# ---- the fake worker ----------------------------------------------------------------------
class _Stream:
    def __init__(self) -> None:
        self.pending = 0
        self.ready = asyncio.Event()


class FakeWorker(pb_grpc.InferenceServiceServicer):
    """Every `step_s` (one engine step) each running stream is given one token.

    It also times the closed loop's hand-over, what the engine's late-admission lead waits
    for: a stream's last token is given at a step (its tick); a request that arrives is paired
    with the earliest unpaired last-token tick (first in, first out) and its lag is the time
    from that tick to its arrival. A client's next request is sent once its previous one has
    ended, so the lag is the way down (worker -> gateway -> client) and back up."""

    def __init__(self, step_s: float) -> None:
        self.step_s = step_s
        self.streams: set[_Stream] = set()
        self.tick = 0.0  # loop.time() of the latest step
        self.ended_at: deque[float] = deque()  # ticks that gave a stream its last token
        self.lags: list[float] = []  # seconds, since the lags were last taken

    def take_lags(self) -> list[float]:
        """The lags since the last call; the unpaired ticks are dropped (a run's last
        requests have no successor)."""
        lags, self.lags = self.lags, []
        self.ended_at.clear()
        return lags

    async def step_loop(self) -> None:
        loop = asyncio.get_running_loop()
        due = loop.time()
        while True:
            due = max(due + self.step_s, loop.time())
            await asyncio.sleep(due - loop.time())
            self.tick = loop.time()
            for s in self.streams:
                s.pending += 1
                s.ready.set()

    async def Generate(self, request: pb.GenerateRequest, context: grpc.aio.ServicerContext,
                       ) -> AsyncIterator[pb.GenerateResponse]:
        async for r in self.serve(request, "", None):
            yield r

    async def GenerateMux(self, request_iterator: AsyncIterator[pb.MuxUp],
                          context: grpc.aio.ServicerContext) -> AsyncIterator[pb.MuxDown]:
        async for frame in MuxSession(self.serve).frames(request_iterator):
            yield frame

    async def serve(self, request: pb.GenerateRequest, _tenant: str, _timeout: float | None,
                    ) -> AsyncGenerator[pb.GenerateResponse, None]:
        """One request, per call or on a mux (as the worker's own `serve`)."""
        if self.ended_at:
            self.lags.append(asyncio.get_running_loop().time() - self.ended_at.popleft())
        n = request.sampling.max_new_tokens or 16
        stream = _Stream()
        self.streams.add(stream)
        sent = 0
        try:
            while sent < n:
                await stream.ready.wait()
                stream.ready.clear()
                k = min(stream.pending, n - sent)  # a front that fell behind sends them as one
                stream.pending = 0
                if sent + k == n:
                    self.ended_at.append(self.tick)
                yield pb.GenerateResponse(chunk=pb.Chunk(
                    token_ids=range(1000 + sent, 1000 + sent + k), text=" tok" * k))
                sent += k
        finally:
            self.streams.discard(stream)
        prompt = len(request.token_ids.ids) or len(request.text.split())
        yield pb.GenerateResponse(complete=pb.Complete(
            finish_reason="length",
            usage=pb.Usage(prompt_tokens=prompt, completion_tokens=sent),
            served_by=pb.ServedBy(adapter_id=request.adapter.adapter_id,
                                  adapter_version=request.adapter.version,
                                  worker_id=WORKER_ID)))


def serve_fake_worker(listen: str, step_s: float, lags: Connection) -> None:
    """The fake worker's process; each message on `lags` is answered with the lags since the
    previous one (FakeWorker.take_lags)."""
    async def run() -> None:
        worker = FakeWorker(step_s)

        def answer() -> None:
            lags.recv()
            lags.send(worker.take_lags())

        asyncio.get_running_loop().add_reader(lags.fileno(), answer)
        handle = await start_server(
            listen, lambda s: pb_grpc.add_InferenceServiceServicer_to_server(worker, s),
            ["slora.v1.InferenceService"], interceptors=[GatewayOnlyInterceptor(GATEWAY_TOKEN)])
        try:
            await worker.step_loop()
        finally:
            await handle.server.stop(0)

    asyncio.run(run())


# ---- the stand-in control plane ----------------------------------------------------------
class FakeControlPlane(ppb_grpc.PlacementServiceServicer):
    def __init__(self, worker_address: str) -> None:
        self.worker_address = worker_address

    async def WatchRouting(self, request_iterator: AsyncIterator[ppb.GatewayMessage],
                           context: grpc.aio.ServicerContext) -> AsyncIterator[ppb.RoutingUpdate]:
        await anext(aiter(request_iterator))  # hello
        yield ppb.RoutingUpdate(
            revision=1, snapshot=True, report_interval_ms=60_000,
            workers=[ppb.WorkerEndpoint(worker_id=WORKER_ID, address=self.worker_address,
                                        up=True)],
            keys=[ppb.KeyGrant(token_sha256=hashlib.sha256(TENANT_KEY.encode()).hexdigest(),
                               key_id="bench", tenant="bench")])
        async for _ in request_iterator:  # acks and reports, ignored
            pass


def serve_control_plane(listen: str, worker_address: str) -> None:
    async def run() -> None:
        cp = FakeControlPlane(worker_address)
        handle = await start_server(
            listen, lambda s: ppb_grpc.add_PlacementServiceServicer_to_server(cp, s),
            ["slora.v1.PlacementService"])
        await handle.server.wait_for_termination()

    asyncio.run(run())


# ---- measuring ----------------------------------------------------------------------------
def lags_ms(conn: Connection) -> list[float]:
    """The fake worker's hand-over lags since the last call, in ms (serve_fake_worker)."""
    conn.send("take")
    return [x * 1e3 for x in conn.recv()]


def measured(run: Any, pids: dict[str, int | list[int]], lags: Connection) -> dict[str, Any]:
    """`run()`'s summary, each process's (or group's) CPU seconds per 1,000 tokens, and the
    hand-over lag's p50 and p90 (FakeWorker)."""
    def spent(p: int | list[int]) -> float:
        return sum(cpu_s(x) for x in ([p] if isinstance(p, int) else p))

    before = {k: spent(p) for k, p in pids.items()}
    lags_ms(lags)
    out: dict[str, Any] = run()
    lag = lags_ms(lags)
    out["handover_lags"] = len(lag)
    out["handover_lag_p50_ms"], out["handover_lag_p90_ms"] = (
        (float(np.percentile(lag, 50)), float(np.percentile(lag, 90))) if lag else (0.0, 0.0))
    tokens = max(out["output_tokens"], 1)
    for k, p in pids.items():
        used = spent(p) - before[k]
        out[f"{k}_cpu_s"] = used
        out[f"{k}_cpu_s_per_1k_tokens"] = used / tokens * 1000
    return out


def pool_pids(pool: Any) -> list[int]:
    """The client pool's worker processes (multiprocessing keeps them in `_pool`)."""
    return [p.pid for p in getattr(pool, "_pool", [])]


@dataclass
class Gateway:
    """One gateway variant: `slora gateway` run from source tree `tree`."""

    name: str
    tree: Path
    grpc: str
    http: str  # the OpenAI API's base URL
    child: Child


def measure(args: argparse.Namespace, pool: Any, worker: tuple[str, int, Connection],
            gateways: list[Gateway], c: int, repeats: int) -> dict[str, Any]:
    """Interleaved repeats: the worker direct, then each gateway over gRPC and HTTP (the
    gateways' order rotates each repeat); CPU is charged to the gateway the run went through."""
    from bench.service_overhead import (
        Lengths,
        bearer,
        compare,
        http_path,
        run_grpc,
        run_http,
        spread,
        workload,
    )

    reqs = workload([], c * args.requests_per_stream, vocab=512)
    n, procs = Lengths(args.new_tokens, args.new_tokens_spread), args.client_procs
    runs: dict[str, list[dict[str, Any]]] = {"direct": []}
    for r in range(repeats):
        direct: dict[str, int | list[int]] = {
            "gateway": gateways[0].child.popen.pid, "worker": worker[1], "client": pool_pids(pool)}
        runs["direct"].append(measured(partial(
            run_grpc, pool, procs, worker[0], ((GATEWAY_HEADER, GATEWAY_TOKEN),), reqs, n, c,
            direct=True), direct, worker[2]))
        for g in gateways[r % len(gateways):] + gateways[:r % len(gateways)]:
            pids: dict[str, int | list[int]] = {
                "gateway": g.child.popen.pid, "worker": worker[1], "client": pool_pids(pool)}
            runs.setdefault(f"{g.name}/grpc", []).append(measured(partial(
                run_grpc, pool, procs, g.grpc, bearer(TENANT_KEY), reqs, n, c), pids,
                worker[2]))
            for lib in args.http_clients:
                runs.setdefault(f"{g.name}/{http_path(lib)}", []).append(measured(partial(
                    run_http, pool, procs, g.http, TENANT_KEY, reqs, n, c, lib), pids,
                    worker[2]))
        line = {k: (round(v[-1]["output_tok_per_s"]),
                    round(v[-1]["gateway_cpu_s_per_1k_tokens"], 3),
                    round(v[-1]["handover_lag_p50_ms"], 2)) for k, v in runs.items()}
        errors = {k: v[-1]["errors"][:2] for k, v in runs.items() if v[-1]["errors"]}
        print(f"c={c} repeat {r + 1}: (tok/s, gateway cpu s/1k tok, hand-over lag p50 ms) "
              f"{line} {errors}", flush=True)
    vs_direct = {k: spread([compare(d, o) for d, o in zip(runs["direct"], v, strict=True)])
                 for k, v in runs.items() if k != "direct"}
    cpu = {k: spread([{"gateway_cpu_s_per_1k_tokens": x["gateway_cpu_s_per_1k_tokens"],
                       "worker_cpu_s_per_1k_tokens": x["worker_cpu_s_per_1k_tokens"],
                       "client_cpu_s_per_1k_tokens": x["client_cpu_s_per_1k_tokens"],
                       "output_tok_per_s": x["output_tok_per_s"],
                       "handover_lag_p50_ms": x["handover_lag_p50_ms"],
                       "handover_lag_p90_ms": x["handover_lag_p90_ms"]} for x in v])
           for k, v in runs.items()}
    return {"concurrency": c, "requests": len(reqs), "vs_direct": vs_direct, "per_path": cpu,
            "runs": runs}


def start_gateway(name: str, tree: Path, cp: str, state: Path, upstream: str) -> Gateway:
    host = "127.0.0.1"
    grpc_at, http_at = f"{host}:{free_port()}", f"{host}:{free_port()}"
    child = start_child(f"gateway-{name}", slora_argv(
        "gateway", "--control-plane", cp, "--listen", grpc_at, "--http-listen", http_at,
        "--base-model-name", BASE_MODEL, "--gateway-id", name),
        state, {GATEWAY_TOKEN_ENV: GATEWAY_TOKEN, CLUSTER_TOKEN_ENV: "slc_bench",
                "SLORA_LOG_LEVEL": "WARNING", "PYTHONPATH": str(tree),
                UPSTREAM_ENV: upstream}, cwd=tree)
    return Gateway(name, tree, grpc_at, f"http://{http_at}/v1", child)


def hardware() -> str:
    from bench.run_record import host_cpu  # torch: not in the spawned servers' imports

    model = host_cpu()["model"]
    return f"{model}, {os.cpu_count()} cores (shared; load average at start {os.getloadavg()[0]:.1f})"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    from bench.service_overhead import http_clients_arg

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--concurrency", default="64,256", help="comma-separated streams in flight")
    ap.add_argument("--requests-per-stream", type=int, default=1)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--new-tokens-spread", type=int, default=0,
                    help="lengths new_tokens +- this, fixed by the prompt (0: all equal, so the "
                         "closed loop runs in waves)")
    ap.add_argument("--step-ms", type=float, default=15.0, help="the fake engine's step time")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--client-procs", type=int, default=4)
    ap.add_argument("--variant", action="append", metavar="NAME=TREE",
                    help="a gateway run from source tree TREE (with its generated protos), "
                         "e.g. before=/tmp/old; repeatable, side by side in one run "
                         "(default: this=.)")
    ap.add_argument("--upstreams", default="mux,call",
                    help="comma-separated gateway -> worker paths, a gateway each per variant: "
                         "mux (GenerateMux), call (one Generate call a request) and auto (per "
                         f"call, then the mux from {MUX_FROM_DEFAULT} streams in flight on the "
                         "worker on)")
    ap.add_argument("--http-clients", default=["httpx"],
                    type=lambda t: [] if t == "none" else http_clients_arg(t),
                    help="comma-separated HTTP client libraries (httpx, aiohttp), a path each; "
                         "none: gRPC only")
    ap.add_argument("--note", default="", help="recorded in the JSON: what the variants differ in")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    if not 0 <= args.new_tokens_spread < args.new_tokens:  # as bench.service_overhead's
        ap.error(f"--new-tokens-spread must be in [0, --new-tokens), got "
                 f"{args.new_tokens_spread}")
    return args


def main() -> int:
    from bench.run_record import run_record

    args = parse_args()
    exit_on_sigterm()  # a time limit still stops the children (`finally`)
    variants = [v.split("=", 1) for v in args.variant or ["this=."]]
    ctx = multiprocessing.get_context("spawn")
    worker_at, cp_at = f"127.0.0.1:{free_port()}", f"127.0.0.1:{free_port()}"
    lags, worker_lags = ctx.Pipe()
    worker = ctx.Process(target=serve_fake_worker,
                         args=(worker_at, args.step_ms / 1e3, worker_lags), daemon=True)
    cp = ctx.Process(target=serve_control_plane, args=(cp_at, worker_at), daemon=True)
    worker.start()
    cp.start()
    state = Path(tempfile.mkdtemp(prefix="slora-gateway-hop-"))
    gateways = [start_gateway(f"{name}-{up}", Path(tree).resolve(), cp_at, state, up)
                for name, tree in variants for up in args.upstreams.split(",")]
    pool = ctx.Pool(args.client_procs)
    try:
        wait_serving(worker_at, timeout_s=60)
        for g in gateways:
            wait_serving(g.grpc, g.child, timeout_s=60)
        assert worker.pid is not None
        result: dict[str, Any] = {
            **run_record(["bench.gateway_hop", *sys.argv[1:]]), "hardware": hardware(),
            "variants": {g.name: str(g.tree) for g in gateways}, "note": args.note,
            "new_tokens": args.new_tokens, "new_tokens_spread": args.new_tokens_spread,
            "step_ms": args.step_ms, "repeats": args.repeats,
            "client_procs": args.client_procs, "levels": []}
        fake = (worker_at, worker.pid, lags)
        measure(args, pool, fake, gateways, 8, 1)  # warm-up
        for c in [int(x) for x in args.concurrency.split(",")]:
            result["levels"].append(measure(args, pool, fake, gateways, c, args.repeats))
            if args.out:  # what is measured so far survives a later failure
                Path(args.out).write_text(json.dumps(result, indent=1))
        for level in result["levels"]:
            print(f"c={level['concurrency']}: " + json.dumps(
                {k: {m: round(v["median"], 3) for m, v in figs.items()}
                 for k, figs in level["per_path"].items()}))
    finally:
        pool.terminate()
        for g in gateways:
            g.child.stop()
        worker.terminate()
        cp.terminate()
    return 0


if __name__ == "__main__":
    sys.exit(main())
