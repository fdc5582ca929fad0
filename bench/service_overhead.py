"""Service overhead: the same requests through the engine in-process, client -> worker (the
worker hop alone), client -> gateway -> worker over gRPC, and (with --http) over the gateway's
OpenAI-compatible HTTP API; interleaved repeats in one run, at each concurrency asked.

    python -m bench.service_overhead [--device cuda --dtype float16 --shape llama2-7b] \
        --concurrency 64,256 --repeats 3 --out bench/results/service-overhead-cpu.json

Every path keeps `c` requests in flight (a new one starts when one ends) until all requests are
done; the in-process baseline does the same with `LLMEngine.add_request`. Clients (gRPC and
HTTP) run in several processes, asyncio each, so the client's own CPU does not bound the service.
Ratios are taken per repeat (each path against the in-process run next to it) and reported as
median and spread; TTFT added compares the median and p99 TTFT of the same repeat.
"""

from __future__ import annotations

import argparse
import asyncio
import heapq
import json
import math
import multiprocessing
import os
import platform
import sys
import tempfile
import time
import uuid
from collections import Counter
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np
import torch

from bench.hop_trace import (
    cores,
    join_table,
    joins,
    legs,
    loop_table,
    loops,
    read,
    table,
)
from bench.process_cpu import StackCpu
from bench.run_record import run_record
from bench.serving import SHAPES
from devtools.demo_assets import write_demo_assets
from devtools.demo_stack import (
    BASE_MODEL,
    Stack,
    StackConfig,
    publish_demo_adapters,
    wait_until_routable,
)
from services.commands.gateway import (
    MUX_FROM_DEFAULT,
    MUX_FROM_ENV,
    UPSTREAM_DEFAULT,
    UPSTREAM_ENV,
)
from services.common import hop_trace
from services.common.hop_auth import GATEWAY_HEADER
from services.common.processes import exit_on_sigterm
from services.control_plane.api.client import AdminClient
from services.worker.startup import compile_cache_root, open_compile_cache
from slora_core.admission import SUMMARY_PREFIX
from slora_core.config import EngineConfig
from slora_core.engine import LLMEngine
from slora_core.engine_args import add_engine_args, engine_cli_args, engine_config_kwargs
from slora_core.sampling_params import SamplingParams

Request = tuple[list[int], str]  # prompt ids, adapter ("" = base model)
VERSION = "v1"  # what publish_demo_adapters registers


Ttft = tuple[float, float]  # (from the run's start, from the request's send)


@dataclass(frozen=True)
class Lengths:
    """The tokens each request asks for (`ignore_eos`): `new_tokens`, or with `spread` S a
    length in new_tokens +- S fixed by its prompt, so the same on every path and repeat.
    Equal lengths run a closed loop in waves (bench/closed_loop_waves.py)."""
    new_tokens: int
    spread: int = 0

    def of(self, prompt: list[int]) -> int:
        if not self.spread:
            return self.new_tokens
        return self.new_tokens - self.spread + sum(prompt) % (2 * self.spread + 1)


def workload(names: list[str], n: int, vocab: int) -> list[Request]:
    rng = np.random.default_rng(0)
    adapters = ["", *names]
    return [(rng.integers(3, vocab, int(rng.integers(8, 64))).tolist(), adapters[i % len(adapters)])
            for i in range(n)]


def summarize(wall: float, tokens: int, ttft: list[Ttft], errors: list[str] | None = None,
              ) -> dict[str, Any]:
    """`ttft`: per request, (first token from the run's start, from the request's own send).
    The first (`ttft_*`, what this bench always reported) counts a request's wait for a free
    stream, so with more requests than streams it follows the earlier requests' whole length;
    the second (`request_ttft_*`) is TTFT as a caller sees it, from its send."""
    t = np.asarray([x[0] for x in ttft] or [float("nan")], dtype=float)
    r = np.asarray([x[1] for x in ttft] or [float("nan")], dtype=float)
    return {"wall_s": wall, "output_tokens": tokens, "output_tok_per_s": tokens / wall,
            "ttft_p50_s": float(np.median(t)), "ttft_p90_s": float(np.percentile(t, 90)),
            "ttft_p99_s": float(np.percentile(t, 99)),
            "request_ttft_p50_s": float(np.median(r)),
            "request_ttft_p99_s": float(np.percentile(r, 99)), "errors": errors or []}


# ---- in process ---------------------------------------------------------------------------
@dataclass
class StepLog:
    """An in-process run step by step (bench/closed_loop_waves.py): the requests added before
    each step, and per request the steps from its add to its first token."""
    adds: list[int] = field(default_factory=list)
    to_first: Counter[int] = field(default_factory=Counter)


def run_in_process(engine: LLMEngine, reqs: list[Request], new_tokens: Lengths, concurrency: int,
                   arrivals: list[float] | None = None, log: StepLog | None = None,
                   arrive_after_s: float = 0.0, arrive_spread_s: float = 0.0,
                   seed: int = 0) -> dict[str, Any]:
    """Closed loop (`concurrency` in flight, the next request added as one finishes), or with
    `arrivals` open loop: request i arrives `arrivals[i]` s after the start and is added at the
    first step boundary after that; its TTFT counts from its arrival. `arrive_after_s` (closed
    loop): a finished request's successor arrives that long after the step that finished it
    returned, as through a service its send and the hops take time, and is added at the first
    step boundary after that, its TTFT counted from its arrival (0: added before the next
    step, TTFT from the add). `arrive_spread_s`: each successor later still by a uniform draw
    from [0, arrive_spread_s) (`seed`'s, the same each run), as a service's hops are not
    equally long for every request. `log`: filled as the steps go."""
    pending = list(enumerate(reqs))[::-1]
    rng = np.random.default_rng(seed)
    first: dict[str, Ttft] = {}
    added: dict[str, float] = {}
    added_at: dict[str, int] = {}  # rid -> the step it was added before
    tokens = 0
    t0 = time.perf_counter()
    # Closed loop: when each free stream's next request arrives (a heap: with a spread the
    # successors need not arrive in the order their predecessors finished).
    free = [t0] * concurrency

    def next_arrival() -> float:  # closed loop with every stream busy: none
        if arrivals is not None:
            return t0 + arrivals[pending[-1][0]]
        return free[0] if free else math.inf

    while pending or engine.has_unfinished():
        if pending and not engine.has_unfinished():  # idle: every stream is free
            time.sleep(max(0.0, next_arrival() - time.perf_counter()))
        adds = 0
        while pending and next_arrival() <= time.perf_counter():
            arrived = next_arrival()
            i, (prompt, adapter) = pending.pop()
            rid = f"r{i}-{t0}"
            if arrivals is None:
                heapq.heappop(free)
            added[rid] = (time.perf_counter()
                          if arrivals is None and not arrive_after_s and not arrive_spread_s
                          else arrived)
            params = SamplingParams(temperature=0, max_new_tokens=new_tokens.of(prompt),
                                    ignore_eos=True)
            engine.add_request(rid, prompt, params, adapter=adapter or None)
            adds += 1
            if log is not None:
                added_at[rid] = len(log.adds)
        outs = engine.step()
        returned = time.perf_counter()
        if log is not None:
            log.adds.append(adds)
        for out in outs:
            if out.token_ids and out.request_id not in first:
                now = time.perf_counter()
                first[out.request_id] = (now - t0, now - added[out.request_id])
                if log is not None:
                    log.to_first[len(log.adds) - added_at[out.request_id]] += 1
            tokens += len(out.token_ids)
            if out.finished:
                late = arrive_after_s + rng.uniform(0.0, arrive_spread_s)
                heapq.heappush(free, returned + late)
    return summarize(time.perf_counter() - t0, tokens, list(first.values()))


# ---- gRPC, from client processes -----------------------------------------------------------
def _grpc_client(target: str, md: tuple[tuple[str, str], ...], reqs: list[Request],
                 new_tokens: Lengths,
                 concurrency: int, direct: bool, start_at: float, channels: int = 1,
                 arrivals: list[float] | None = None, tag: str = "",
                 ) -> tuple[list[Ttft], int, list[str]]:
    """One client process: `reqs` with `concurrency` in flight, from wall-clock `start_at`,
    spread round-robin over `channels` connections (a multi-process gateway gets one process
    per connection). With `arrivals`, request i is sent `arrivals[i]` s after `start_at`
    whatever is in flight; TTFT counts from the send. `tag`: names the run in hop traces
    (`--trace-hops`), where each request also gets an id of its own."""
    import grpc

    from slora.v1 import inference_pb2 as pb
    from slora.v1 import inference_pb2_grpc as pb_grpc

    def message(prompt: list[int], adapter: str) -> pb.GenerateRequest:
        ref = pb.AdapterRef(adapter_id=adapter)
        if adapter and direct:
            ref.version = VERSION  # workers serve explicit versions
        return pb.GenerateRequest(token_ids=pb.TokenIds(ids=prompt), adapter=ref,
                                  request_id=uuid.uuid4().hex if tracing else "",
                                  sampling=pb.SamplingOptions(temperature=0,
                                                              max_new_tokens=new_tokens.of(prompt),
                                                              ignore_eos=True))

    tracing = hop_trace.enabled()

    async def run() -> tuple[list[Ttft], int, list[str]]:
        ttft: list[Ttft] = []
        errors: list[str] = []
        count = 0
        slots = asyncio.Semaphore(concurrency)
        # A subchannel pool of its own per channel: a connection each (else they share one).
        opened = [grpc.aio.insecure_channel(target,
                                            options=[("grpc.use_local_subchannel_pool", 1)])
                  for _ in range(channels)]
        stubs = [pb_grpc.InferenceServiceStub(c) for c in opened]
        try:
            await asyncio.sleep(max(0.0, start_at - time.time()))

            async def call(req: pb.GenerateRequest, stub: Any, at: float | None) -> None:
                nonlocal count
                if at is not None:
                    await asyncio.sleep(max(0.0, start_at + at - time.time()))
                async with slots:
                    # TTFT counts from the send: an open-loop arrival's timer fires about
                    # a millisecond late (epoll's resolution), which is the load
                    # generator's, not the service's (the trace keeps both).
                    sent, first = time.time(), None
                    if tracing:
                        hop_trace.mark("client_tag", f"{req.request_id}={tag}")
                        hop_trace.mark("client_send", req.request_id,
                                       sent if at is None else start_at + at)
                        hop_trace.mark("client_sent", req.request_id, sent)
                    try:
                        async for resp in stub.Generate(req, timeout=600, metadata=md):
                            if resp.HasField("chunk") and resp.chunk.token_ids:
                                first = first if first is not None else time.time()
                                count += len(resp.chunk.token_ids)
                            elif tracing and resp.HasField("complete"):
                                hop_trace.mark("client_complete", req.request_id)
                    except grpc.aio.AioRpcError as e:
                        errors.append(f"{e.code().name}: {e.details()}")
                        return
                    first = first if first is not None else time.time()
                    ttft.append((first - start_at, first - sent))
                    hop_trace.mark("client_first", req.request_id, first)
                    hop_trace.mark("client_done", req.request_id)

            await asyncio.gather(*(call(message(p, a), stubs[i % channels],
                                        None if arrivals is None else arrivals[i])
                                   for i, (p, a) in enumerate(reqs)))
        finally:
            for c in opened:
                await c.close()
        return ttft, count, errors

    return asyncio.run(run())


def run_grpc(pool: Any, procs: int, target: str, md: tuple[tuple[str, str], ...],
             reqs: list[Request], new_tokens: Lengths, concurrency: int, direct: bool = False,
             channels: int = 1, arrivals: list[float] | None = None, tag: str = "",
             ) -> dict[str, Any]:
    """`md`: the tenant key for a gateway, the gateway token for a worker called directly."""
    start_at = time.time() + 0.5
    shares = [(target, md, reqs[k::procs], new_tokens, max(1, concurrency // procs), direct,
               start_at, channels, None if arrivals is None else arrivals[k::procs], tag)
              for k in range(procs)]
    got = pool.starmap(_grpc_client, shares)
    wall = time.time() - start_at
    ttft = [t for g in got for t in g[0]]
    return summarize(wall, sum(g[1] for g in got), ttft, [e for g in got for e in g[2]])


def bearer(token: str) -> tuple[tuple[str, str], ...]:
    return (("authorization", f"Bearer {token}"),)


# ---- HTTP (OpenAI-compatible SSE) ----------------------------------------------------------
class _HttpStatus(Exception):
    """A response that is not 200 (the request's error: `HTTP <code>`)."""


def _http_client(base_url: str, token: str, reqs: list[Request], new_tokens: Lengths,
                 concurrency: int, start_at: float, client_lib: str = "httpx",
                 arrivals: list[float] | None = None, tag: str = "",
                 ) -> list[tuple[Ttft, int, str]]:
    """One client process: the requests streamed through the gateway's HTTP API (SSE), from
    wall-clock `start_at`; (ttft, tokens from the stream's usage, error) per request.
    `client_lib`: httpx (what the openai SDK uses) or aiohttp (what vLLM's serving benchmark
    uses); both read every event line and parse its JSON. `arrivals`, `tag`: as
    `_grpc_client`'s (a request's trace key is the id of its first event)."""
    body_of = partial(_completion_body, new_tokens)
    at: list[float | None] = list(arrivals) if arrivals is not None else [None] * len(reqs)
    headers = {"authorization": f"Bearer {token}"}
    failed: Ttft = (float("nan"), float("nan"))
    slots = asyncio.Semaphore(concurrency)

    def seen(line: str, first: float | None, n: int, sent: tuple[float, float],
             ) -> tuple[float | None, int]:
        """`first`: when the first token's event came (wall clock); `n`: tokens by usage;
        `sent`: (arrival, actual send), traced with the first event's id."""
        if not line.startswith("data: {"):
            return first, n
        event = json.loads(line[6:])
        if event["choices"] and first is None:
            first = time.time()
            if hop_trace.enabled():
                rid = event["id"]
                hop_trace.mark("client_tag", f"{rid}={tag}")
                hop_trace.mark("client_send", rid, sent[0])
                hop_trace.mark("client_sent", rid, sent[1])
                hop_trace.mark("client_first", rid, first)
        if event.get("usage"):
            n = event["usage"]["completion_tokens"]
        return first, n

    async def call(lines: Callable[[dict[str, Any]], AsyncIterator[str]],
                   errors: tuple[type[Exception], ...], prompt: list[int], adapter: str,
                   offset: float | None) -> tuple[Ttft, int, str]:
        """One request: sent at its open-loop arrival (`offset`) or when a slot frees, its
        event lines read through `lines`; TTFT from the send."""
        if offset is not None:
            await asyncio.sleep(max(0.0, start_at + offset - time.time()))
        first: float | None = None
        n = 0
        async with slots:
            sent = time.time()  # TTFT from the send, as in `_grpc_client`
            arrival = sent if offset is None else start_at + offset
            try:
                async for line in lines(body_of(prompt, adapter or BASE_MODEL)):
                    first, n = seen(line, first, n, (arrival, sent))
            except _HttpStatus as e:
                return failed, 0, f"HTTP {e}"
            except errors as e:
                return failed, 0, f"{type(e).__name__}: {e}"
        if first is None:
            return failed, n, "no token event"
        return (first - start_at, first - sent), n, ""

    async def run_httpx() -> list[tuple[Ttft, int, str]]:
        import httpx

        limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
        async with httpx.AsyncClient(base_url=base_url, limits=limits, timeout=600,
                                     headers=headers) as client:

            async def lines(body: dict[str, Any]) -> AsyncIterator[str]:
                async with client.stream("POST", "/completions", json=body) as resp:
                    if resp.status_code != 200:
                        raise _HttpStatus(resp.status_code)
                    async for line in resp.aiter_lines():
                        yield line

            await asyncio.sleep(max(0.0, start_at - time.time()))
            return await asyncio.gather(*(call(lines, (httpx.HTTPError,), p, a, o)
                                          for (p, a), o in zip(reqs, at, strict=True)))

    async def run_aiohttp() -> list[tuple[Ttft, int, str]]:
        import aiohttp

        url = base_url.rstrip("/") + "/completions"
        connector = aiohttp.TCPConnector(limit=concurrency)
        async with aiohttp.ClientSession(connector=connector, headers=headers,
                                         timeout=aiohttp.ClientTimeout(total=600)) as session:

            async def lines(body: dict[str, Any]) -> AsyncIterator[str]:
                async with session.post(url, json=body) as resp:
                    if resp.status != 200:
                        raise _HttpStatus(resp.status)
                    async for raw in resp.content:
                        yield raw.decode().rstrip("\r\n")

            await asyncio.sleep(max(0.0, start_at - time.time()))
            return await asyncio.gather(*(call(lines, (aiohttp.ClientError,), p, a, o)
                                          for (p, a), o in zip(reqs, at, strict=True)))

    if client_lib not in HTTP_CLIENTS:
        raise ValueError(f"unknown HTTP client {client_lib!r} (one of {HTTP_CLIENTS})")
    return asyncio.run(run_httpx() if client_lib == "httpx" else run_aiohttp())


HTTP_CLIENTS = ("httpx", "aiohttp")


def http_path(client_lib: str) -> str:
    """The run's name for HTTP through `client_lib` (httpx keeps the name it always had)."""
    return "http" if client_lib == "httpx" else f"http_{client_lib}"


def http_clients_arg(text: str) -> list[str]:
    """--http-clients: comma-separated names from HTTP_CLIENTS, refused at parse time."""
    libs = [x.strip() for x in text.split(",") if x.strip()]
    unknown = [x for x in libs if x not in HTTP_CLIENTS]
    if not libs or unknown:
        raise argparse.ArgumentTypeError(
            f"unknown HTTP client(s) {unknown or text!r}; choose from {', '.join(HTTP_CLIENTS)}")
    return libs


def numbers_arg(what: str, unit: str, zero_ok: bool = False) -> Callable[[str], list[float]]:
    """An argparse type: comma-separated numbers of `unit`, each over 0 (or 0 with
    `zero_ok`); a clear usage error names `what` otherwise."""
    def parse(text: str) -> list[float]:
        try:
            values = [float(x) for x in text.split(",")]
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not comma-separated numbers") from None
        if any(not (v >= 0 if zero_ok else v > 0) for v in values):
            raise argparse.ArgumentTypeError(
                f"every {what} must be {'>=' if zero_ok else '>'} 0 {unit}, got {text!r}")
        return values
    return parse


rates_arg = numbers_arg("rate", "requests/s")  # --rates


def one_number(what: str, unit: str) -> Callable[[str], float]:
    """An argparse type: one number of `unit`, 0 or more; a clear usage error otherwise."""
    many = numbers_arg(what, unit, zero_ok=True)

    def parse(text: str) -> float:
        values = many(text)
        if len(values) != 1:
            raise argparse.ArgumentTypeError(f"one {what} in {unit} expected, got {text!r}")
        return values[0]
    return parse


def _completion_body(new_tokens: Lengths, prompt: list[int], adapter: str) -> dict[str, Any]:
    return {"model": adapter, "prompt": prompt, "max_tokens": new_tokens.of(prompt),
            "temperature": 0,
            "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}


def run_http(pool: Any, procs: int, base_url: str, token: str, reqs: list[Request],
             new_tokens: Lengths, concurrency: int, client_lib: str = "httpx",
             arrivals: list[float] | None = None, tag: str = "") -> dict[str, Any]:
    start_at = time.time() + 0.5
    shares = [(base_url, token, reqs[k::procs], new_tokens, max(1, concurrency // procs),
               start_at, client_lib, None if arrivals is None else arrivals[k::procs], tag)
              for k in range(procs)]
    got = [r for share in pool.starmap(_http_client, shares) for r in share]
    wall = time.time() - start_at
    ok = [(f, n) for f, n, err in got if not err]
    return summarize(wall, sum(n for _, n in ok), [f for f, _ in ok],
                     [err for _, _, err in got if err])


# ---- the run ------------------------------------------------------------------------------
def compare(base: dict[str, Any], other: dict[str, Any]) -> dict[str, float]:
    return {"throughput_ratio": other["output_tok_per_s"] / base["output_tok_per_s"],
            "ttft_p50_added_ms": (other["ttft_p50_s"] - base["ttft_p50_s"]) * 1e3,
            "ttft_p99_added_ms": (other["ttft_p99_s"] - base["ttft_p99_s"]) * 1e3,
            "request_ttft_p50_added_ms": (other["request_ttft_p50_s"]
                                          - base["request_ttft_p50_s"]) * 1e3,
            "request_ttft_p99_added_ms": (other["request_ttft_p99_s"]
                                          - base["request_ttft_p99_s"]) * 1e3}


def spread(rows: list[dict[str, float]]) -> dict[str, Any]:
    """Median, min and max of each figure over the repeats."""
    return {k: {"median": float(np.median([r[k] for r in rows])),
                "min": min(r[k] for r in rows), "max": max(r[k] for r in rows)}
            for k in rows[0]}


def write_assets(args: argparse.Namespace, root: Path) -> Any:
    if args.shape == "tiny":
        return write_demo_assets(root / "demo", seed=0)
    shape = {k: v for k, v in SHAPES[args.shape].items() if k != "vocab_size"}
    shape |= {"head_dim": shape["hidden_size"] // shape["num_attention_heads"],
              "max_position_embeddings": 4096}
    return write_demo_assets(root / "demo", seed=0, model_overrides=shape,
                             adapters=("qv-r4", "attn-r8", "all-r16"), dtype=torch.float16,
                             device=args.device)


def engine_settings(args: argparse.Namespace, max_seqs: int) -> tuple[dict[str, Any],
                                                                       tuple[str, ...]]:
    """The same engine settings for the in-process engine and the worker (as its flags)."""
    engine = engine_config_kwargs(args) | {
        "max_num_seqs": max_seqs, "max_adapters_per_batch": 8, "max_queue": 4096}
    return engine, tuple(engine_cli_args(engine))


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--concurrency", default="16",
                    help="comma-separated numbers of requests in flight, e.g. 64,256")
    ap.add_argument("--requests-per-stream", type=int, default=2,
                    help="requests = this x the concurrency")
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--new-tokens-spread", type=int, default=0,
                    help="each request asks for --new-tokens +- this many tokens (fixed by its "
                         "prompt, the same on every path); 0: all alike, which runs a closed "
                         "loop in waves")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--shape", default="tiny", choices=sorted(SHAPES),
                    help="model shape: the tiny demo model, or a real size written to disk "
                         "(fp16, 3 of the demo adapters)")
    ap.add_argument("--client-procs", type=int, default=4, help="gRPC client processes")
    ap.add_argument("--gateway-procs", type=int, default=1,
                    help="gateway processes on the same ports (slora gateway --processes)")
    ap.add_argument("--client-channels", type=int, default=1,
                    help="gRPC connections per client process (the kernel gives each to one "
                         "gateway process; HTTP clients open one per stream anyway)")
    ap.add_argument("--http", action="store_true",
                    help="also stream the same workload through the gateway's HTTP API (SSE)")
    ap.add_argument("--http-clients", default=["httpx"], type=http_clients_arg,
                    help=f"comma-separated HTTP client libraries, each a path of its own "
                         f"(httpx: `http`, aiohttp: `http_aiohttp`), from {HTTP_CLIENTS}")
    ap.add_argument("--rates", default=None, type=rates_arg,
                    help="comma-separated open-loop arrival rates (requests/s): each a level "
                         "of Poisson arrivals, the same on every path, instead of the closed "
                         "loop of --concurrency (whose highest value caps what is in flight)")
    ap.add_argument("--open-loop-s", type=float, default=4.0,
                    help="seconds of arrivals at each --rates level")
    ap.add_argument("--trace-hops", default=None, type=Path, metavar="DIR",
                    help="trace every request's first token through each process into DIR "
                         "(services/common/hop_trace.py) and add each leg's times per path "
                         "and level to the JSON (`hop_trace`); tracing costs the processes "
                         "a few microseconds an event")
    ap.add_argument("--trace-hops-events", default=None, metavar="PREFIX,...",
                    type=lambda v: [x for x in v.split(",") if x],
                    help="with --trace-hops: trace only the events whose names begin with one "
                         "of these (e.g. core_,loop_: the engine core alone; the others write "
                         "nothing); the JSON then records the filter, not the legs (a "
                         "request's legs need the client's events)")
    ap.add_argument("--also-upstream", choices=("mux", "call", "auto"), default=None,
                    help="also run a second gateway (as many processes) with `--upstream X` "
                         f"beside the default one ({UPSTREAM_DEFAULT}, or env {UPSTREAM_ENV}): "
                         "call is one Generate call per request, mux one GenerateMux stream "
                         f"per worker, auto the mux from {MUX_FROM_DEFAULT} streams in flight "
                         "on a worker in a gateway process on; the `gateway_X` path, side by "
                         "side")
    ap.add_argument("--in-process-arrive-after-ms", default=[], type=numbers_arg("delay", "ms"),
                    metavar="D,...",
                    help="closed loop: also run the in-process loop with each finished "
                         "request's successor arriving D ms after the step that finished it "
                         "(added at the next step boundary, TTFT from its arrival), a path "
                         "each (in_process_after_Dms), beside the others")
    ap.add_argument("--in-process-arrive-spread-ms", default=0.0,
                    type=one_number("spread", "ms"), metavar="S",
                    help="with --in-process-arrive-after-ms: also run each of those loops with "
                         "every successor later still by a uniform draw from [0, S) ms "
                         "(in_process_after_Dms_spreadSms): arrivals spread over a step, as "
                         "a service's are, rather than all at once")
    ap.add_argument("--worker-admission-leads", default=[], metavar="L,...",
                    type=numbers_arg("lead", "ms", zero_ok=True),
                    help="run the worker at each late-admission lead in turn (its "
                         "--admission-lead-ms; 0: off), restarting it between them (same name "
                         "and compile cache), every level at each; the in-process engine, "
                         "assets and clients stay: one run, side by side")
    ap.add_argument("--worker-mux-pump-ms", default=[], metavar="P,...",
                    type=numbers_arg("pump", "ms", zero_ok=True),
                    help="run the worker at each mux writer's time a frame in turn (its "
                         "--mux-pump-ms; 0: a step's every stream in one frame), restarting "
                         "it between them, as --worker-admission-leads (with both: every "
                         "pair)")
    ap.add_argument("--out", default=None)
    # The same engine on both sides; max_num_seqs follows the highest concurrency.
    add_engine_args(ap, defaults={"num_pages": 128},
                    skip=("max_num_seqs", "max_adapters_per_batch", "max_queue"))
    args = ap.parse_args(argv)
    if args.in_process_arrive_spread_ms and not args.in_process_arrive_after_ms:
        ap.error("--in-process-arrive-spread-ms needs --in-process-arrive-after-ms (the "
                 "late loops it spreads)")
    if not 0 <= args.new_tokens_spread < args.new_tokens:
        ap.error(f"--new-tokens-spread must be in [0, --new-tokens), got "
                 f"{args.new_tokens_spread}")
    if args.trace_hops_events == []:  # given, but only commas: it would trace everything
        ap.error("--trace-hops-events needs at least one event prefix, e.g. core_,loop_")
    if args.trace_hops_events and args.trace_hops is None:
        ap.error("--trace-hops-events needs --trace-hops (the folder the events go to)")
    if args.trace_hops is not None and any(args.trace_hops.glob("*.hops")):
        # Another run's events would join this run's legs under the same tags.
        ap.error(f"--trace-hops {args.trace_hops} already holds traces (*.hops): "
                 "give an empty or new folder")
    return args


def late_path(delay_ms: float, spread_ms: float = 0.0) -> str:
    """The path name of the in-process loop whose successors arrive `delay_ms` late (and up
    to `spread_ms` more, uniformly)."""
    return f"in_process_after_{delay_ms:g}ms" + (f"_spread{spread_ms:g}ms" if spread_ms else "")


def poisson_arrivals(n: int, rate: float, seed: int = 0) -> list[float]:
    """`n` arrival offsets (s) of a Poisson process of `rate` requests/s, the same each run."""
    gaps = np.random.default_rng(seed).exponential(1.0 / rate, n)
    return [float(t) for t in np.cumsum(gaps) - gaps[0]]


def busy_during(stack: Stack, gateway: str, run: Callable[[], dict[str, Any]],
                ) -> dict[str, Any]:
    """`run()`'s result with `cpu_busy`: how busy the worker's front, its core and
    `gateway`'s processes were meanwhile (bench/process_cpu.py)."""
    cpu = StackCpu.of(stack.workers["worker-0"].popen.pid, stack.gateways[gateway].popen.pid)
    cpu.start()
    got = run()
    got["cpu_busy"] = cpu.busy(got["wall_s"])
    return got


@dataclass(frozen=True)
class WorkerVariant:
    """The worker's settings a run restarts it at (None: as its arguments say)."""

    lead_ms: float | None = None  # --admission-lead-ms
    mux_pump_ms: float | None = None  # --mux-pump-ms

    def flags(self) -> tuple[str, ...]:
        """The worker's flags (argparse takes the last of a repeated flag)."""
        return (*(() if self.lead_ms is None else ("--admission-lead-ms", f"{self.lead_ms:g}")),
                *(() if self.mux_pump_ms is None else ("--mux-pump-ms", f"{self.mux_pump_ms:g}")))

    def label(self) -> str:
        """What hop traces' tags and the log name it by ("" for the defaults)."""
        return ((f" lead={self.lead_ms:g}ms" if self.lead_ms is not None else "")
                + (f" pump={self.mux_pump_ms:g}ms" if self.mux_pump_ms is not None else ""))

    def record(self) -> dict[str, float]:
        """The level's fields naming it."""
        return {**({} if self.lead_ms is None else {"worker_admission_lead_ms": self.lead_ms}),
                **({} if self.mux_pump_ms is None else
                   {"worker_mux_pump_ms": self.mux_pump_ms})}


def worker_variants(args: argparse.Namespace) -> list[WorkerVariant]:
    """Every (lead, pump) pair the arguments ask for, in turn; one default variant if none."""
    return [WorkerVariant(lead, pump) for lead in (args.worker_admission_leads or [None])
            for pump in (args.worker_mux_pump_ms or [None])]


def measure(args: argparse.Namespace, stack: Stack, engine: LLMEngine, token: str,
            pool: Any, reqs: list[Request], c: int, rate: float | None = None,
            variant: WorkerVariant = WorkerVariant()) -> dict[str, Any]:
    """Interleaved repeats of every path at concurrency `c` (closed loop), or with `rate`
    open loop: the same Poisson arrivals on every path, at most `c` in flight. `variant`: the
    worker's settings (--worker-admission-leads, --worker-mux-pump-ms), which hop traces'
    tags name."""
    arrivals = poisson_arrivals(len(reqs), rate) if rate is not None else None
    # Open loop: the clients hold nothing back (the engines queue what exceeds their seqs);
    # each client process may have all its share in flight.
    cap = c if rate is None else len(reqs) * args.client_procs
    gateway, worker = stack.gateway_addresses["gateway"], stack.worker_addresses["worker-0"]
    runs: dict[str, list[dict[str, Any]]] = {"in_process": [], "worker": [], "gateway": []}
    gateways = {"gateway": gateway}
    if args.also_upstream:  # the second gateway, gateway_mux or gateway_call
        other = f"gateway_{args.also_upstream}"
        gateways[other] = stack.gateway_addresses[other]
        runs[other] = []
    http_paths = {http_path(lib): lib for lib in args.http_clients} if args.http else {}
    for path in http_paths:
        runs[path] = []
    # The in-process loop again with its successors arriving late, as through a service
    # (closed loop only): how much of a path's added TTFT is the step it then waits out.
    spreads = (0.0, args.in_process_arrive_spread_ms) if args.in_process_arrive_spread_ms \
        else (0.0,)
    late = {late_path(d, sp): (d, sp) for d in args.in_process_arrive_after_ms
            for sp in spreads} if rate is None else {}
    for path in late:
        runs[path] = []
    label = (f"c={c}" if rate is None else f"rate={rate:g}/s") + variant.label()
    lengths = Lengths(args.new_tokens, args.new_tokens_spread)
    for r in range(args.repeats):
        runs["in_process"].append(run_in_process(engine, reqs, lengths, c, arrivals))
        for path, (delay_ms, spread_ms) in late.items():
            runs[path].append(run_in_process(engine, reqs, lengths, c,
                                             arrive_after_s=delay_ms / 1e3,
                                             arrive_spread_s=spread_ms / 1e3, seed=r))
        runs["worker"].append(busy_during(stack, "gateway", lambda: run_grpc(
            pool, args.client_procs, worker, ((GATEWAY_HEADER, stack.gateway_token),), reqs,
            lengths, cap, direct=True, channels=args.client_channels, arrivals=arrivals,
            tag=f"worker {label}")))
        for path, address in gateways.items():
            runs[path].append(busy_during(stack, path, partial(
                run_grpc, pool, args.client_procs, address, bearer(token), reqs, lengths, cap,
                channels=args.client_channels, arrivals=arrivals, tag=f"{path} {label}")))
        for path, lib in http_paths.items():
            runs[path].append(busy_during(stack, "gateway", partial(
                run_http, pool, args.client_procs, stack.http_urls["gateway"], token, reqs,
                lengths, cap, lib, arrivals, f"{path} {label}")))
        line = {k: round(v[-1]["output_tok_per_s"], 1) for k, v in runs.items()}
        errors = {k: len(v[-1]["errors"]) for k, v in runs.items() if v[-1]["errors"]}
        fronts = {k: v[-1]["cpu_busy"].get("worker_front") for k, v in runs.items()
                  if "cpu_busy" in v[-1]}
        print(f"{label} repeat {r + 1}: tok/s {line} errors {errors} worker front busy "
              f"{fronts}", flush=True)
    ratios = {k: spread([compare(b, o) for b, o in zip(runs["in_process"], v, strict=True)])
              for k, v in runs.items() if k != "in_process"}
    level: dict[str, Any] = {"concurrency": c, "requests": len(reqs), "ratios": ratios,
                             "runs": runs}
    if rate is not None:
        level["rate"] = rate
    return level


def main() -> int:
    args = parse_args()
    exit_on_sigterm()  # a time limit still stops the stack (`finally`)
    if args.trace_hops is not None:  # before any process starts: they inherit it
        args.trace_hops.mkdir(parents=True, exist_ok=True)
        os.environ[hop_trace.ENV] = str(args.trace_hops.resolve())
        if args.trace_hops_events:
            os.environ[hop_trace.EVENTS_ENV] = ",".join(args.trace_hops_events)
    levels = [int(c) for c in args.concurrency.split(",")]
    root = Path(tempfile.mkdtemp(prefix="slora-overhead-"))
    t0 = time.perf_counter()
    demo = write_assets(args, root)
    # How fast this host is, in the result (a slow host's stack took 107-111 s, not 73).
    startup = {"assets_s": round(time.perf_counter() - t0, 1)}
    print(f"assets written in {startup['assets_s']} s", flush=True)
    names = sorted(demo.adapter_dirs)
    engine_args, worker_args = engine_settings(args, max(levels))
    config = EngineConfig(**engine_args)
    variants = worker_variants(args)
    stack = Stack(StackConfig(demo_dir=demo.root, state_dir=root / "state",
                              worker_args=(*worker_args, *variants[0].flags())))
    results = []
    pool = multiprocessing.get_context("spawn").Pool(args.client_procs)
    try:
        stack.start_control_plane()
        token = publish_demo_adapters(AdminClient.connect(stack.cp_address, stack.admin_token),
                                      demo.root)
        # A 7B worker reads ~13 GB and compiles its kernels (no compile cache here) first.
        stack.start_worker("worker-0", wait_s=300)
        stack.start_gateway(processes=args.gateway_procs)
        wait_until_routable(stack.gateway_addresses["gateway"], token, names, timeout_s=120)
        if args.also_upstream:
            other = f"gateway_{args.also_upstream}"
            stack.start_gateway(other, processes=args.gateway_procs,
                                extra=("--upstream", args.also_upstream))
            wait_until_routable(stack.gateway_addresses[other], token, names, timeout_s=120)
        startup["stack_routable_s"] = round(time.perf_counter() - t0, 1)
        print(f"stack routable {startup['stack_routable_s']} s after the start", flush=True)
        # The in-process engine compiles what the worker just compiled (the same settings):
        # it reads the worker's compile cache instead of compiling again (a minute or more
        # for a 7B engine on the H200: a run at 98e7755 hit its time limit still compiling).
        open_compile_cache(compile_cache_root(root / "state" / "cache" / "worker-0"), config)
        engine = LLMEngine.from_model_dir(demo.model_dir, config)
        for name in names:
            engine.register_adapter(name, demo.root / "adapters" / name)
        engine.warmup()
        warm = workload(names, 8, vocab=512)  # connections, adapter loads, client imports
        for address in stack.gateway_addresses.values():
            run_grpc(pool, args.client_procs, address, bearer(token), warm, Lengths(4), 8,
                     channels=args.client_channels)
        run_in_process(engine, warm, Lengths(4), 8)
        for i, variant in enumerate(variants):
            if i:  # the worker again at these settings (its compile cache)
                restart_worker(stack, variant, token, names)
            for level in run_levels(args, stack, engine, token, pool, names, levels, variant):
                level.update(variant.record())
                pacing = pacing_lines(root / "state" / "logs" / "worker-0.log")
                if variant.lead_ms and pacing:  # its latest summary: GPU idle, slack, host launch
                    level["pacer_latest"] = pacing[-1]
                results.append(level)
                # What is measured so far survives a failure or a time limit.
                write_result(args, results, startup)
    finally:
        pool.terminate()
        stack.stop()
        pacing_report(root / "state" / "logs" / "worker-0.log")
    return 0


def pacing_lines(worker_log: Path) -> list[str]:
    """The worker's late-admission summaries (what its pacing cost the GPU), oldest first."""
    if not worker_log.exists():
        return []
    return [line for line in worker_log.read_text(errors="replace").splitlines()
            if SUMMARY_PREFIX in line]


def pacing_report(worker_log: Path) -> None:
    """Print the worker's late-admission summaries to this log."""
    for line in pacing_lines(worker_log):
        print(line, flush=True)


def run_levels(args: argparse.Namespace, stack: Stack, engine: LLMEngine, token: str,
               pool: Any, names: list[str], levels: list[int],
               variant: WorkerVariant = WorkerVariant(),
               ) -> Iterator[dict[str, Any]]:
    """Each --rates level (open loop) or each concurrency (closed loop), measured."""
    if args.rates:
        for rate in args.rates:
            reqs = workload(names, max(1, round(rate * args.open_loop_s)), vocab=512)
            yield measure(args, stack, engine, token, pool, reqs, max(levels), rate, variant)
    else:
        for c in levels:
            reqs = workload(names, c * args.requests_per_stream, vocab=512)
            yield measure(args, stack, engine, token, pool, reqs, c, variant=variant)


def restart_worker(stack: Stack, variant: WorkerVariant, token: str, names: list[str]) -> None:
    """Stop worker-0 and start it again at `variant`'s settings, routable before return."""
    t0 = time.perf_counter()
    stack.workers.pop("worker-0").stop()
    stack.start_worker("worker-0", extra=variant.flags(), wait_s=300)
    for address in stack.gateway_addresses.values():
        wait_until_routable(address, token, names, timeout_s=120)
    print(f"worker restarted at{variant.label() or ' its defaults'} in "
          f"{time.perf_counter() - t0:.1f} s", flush=True)


def write_result(args: argparse.Namespace, results: list[dict[str, Any]],
                 startup: dict[str, float]) -> None:
    """The result so far; `startup`: the host's start-up times."""
    result = {
        # The command, commit, host CPU and library versions (tokenizers: the front's text
        # window runs in Rust from 0.22 on).
        **run_record(["bench.service_overhead", *sys.argv[1:]]),
        "hardware": torch.cuda.get_device_name() if args.device.startswith("cuda")
        else f"{platform.machine()} CPU, {torch.get_num_threads()} threads",
        "startup_s": startup,
        # What the worker runs with where --worker-admission-leads names no lead.
        "worker_admission_lead_ms_default": EngineConfig().admission_lead_ms,
        "shape": args.shape, "new_tokens": args.new_tokens,
        "new_tokens_spread": args.new_tokens_spread, "async_steps": args.async_steps,
        "repeats": args.repeats, "client_procs": args.client_procs,
        "client_channels": args.client_channels, "gateway_procs": args.gateway_procs,
        # How each gateway path called the worker (the default gateway as its env said).
        "upstreams": {"gateway": os.environ.get(UPSTREAM_ENV, UPSTREAM_DEFAULT),
                      **({f"gateway_{args.also_upstream}": args.also_upstream}
                         if args.also_upstream else {})},
        # auto's threshold (streams in flight a gateway process), which moved (32 -> 8).
        "gateway_mux_from": int(os.environ.get(MUX_FROM_ENV, MUX_FROM_DEFAULT)),
        # Issue 37's: the gRPC hop's TTFT at 64 and 256 streams, HTTP's at 256.
        "targets": {"gateway request_ttft_p50_added_ms": {"64": "<= 3", "256": "<= 10"},
                    "http throughput_ratio": {"256": ">= 0.95"},
                    "http request_ttft_p50_added_ms": {"256": "<= 20"}},
        "levels": results,
    }
    if args.trace_hops_events:
        result["trace_hops_events"] = args.trace_hops_events
    elif args.trace_hops is not None:
        traced = read(args.trace_hops)
        result["hop_trace"] = legs(traced)
        by_core = cores(args.trace_hops)
        result["hop_trace_loops"] = loops(by_core, traced)
        result["hop_trace_joins"] = joins(by_core, traced)
    for level in results:
        lead = (f" worker admission lead {level['worker_admission_lead_ms']:g} ms"
                if "worker_admission_lead_ms" in level else "") + (
            f" mux pump {level['worker_mux_pump_ms']:g} ms" if "worker_mux_pump_ms" in level
            else "")
        print((f"rate={level['rate']:g}/s" if "rate" in level
               else f"c={level['concurrency']}") + f"{lead}:")
        for path, figs in level["ratios"].items():
            print(f"  {path:8s} " + "  ".join(
                f"{k} {v['median']:.3f} [{v['min']:.3f}, {v['max']:.3f}]" for k, v in figs.items()))
    if "hop_trace" in result:
        print(table(result["hop_trace"]), flush=True)
        print(loop_table(result["hop_trace_loops"]), flush=True)
        print(join_table(result["hop_trace_joins"]), flush=True)
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    sys.exit(main())
