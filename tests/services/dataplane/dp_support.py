"""Helpers of the data-plane tests: a client for Generate, metrics scraping, the routing
stream as a gateway sees it."""

from __future__ import annotations

import re
import threading
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass, field

import grpc

from services.common.cluster_token import cluster_metadata
from services.gateway.table import RoutingTable
from slora.v1 import inference_pb2 as pb
from slora.v1 import inference_pb2_grpc as pb_grpc
from slora.v1 import placement_pb2 as ppb
from slora.v1 import placement_pb2_grpc as ppb_grpc

PROMPTS = ["The quick brown fox", "Once upon a time in the city", "Music from the festival"]


@dataclass
class Result:
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    chunks: int = 0
    complete: pb.Complete | None = None
    error: grpc.StatusCode | None = None
    details: str = ""


def request(text: str = PROMPTS[0], adapter: str = "", version: str | None = None,
            routing_key: str = "", max_new_tokens: int = 8, **sampling: object,
            ) -> pb.GenerateRequest:
    ref = pb.AdapterRef(adapter_id=adapter)
    if version is not None:
        ref.version = version
    opts = pb.SamplingOptions(max_new_tokens=max_new_tokens, **sampling)  # type: ignore[arg-type]
    return pb.GenerateRequest(text=text, adapter=ref, sampling=opts, routing_key=routing_key)


def generate(address: str, req: pb.GenerateRequest, token: str = "", timeout: float = 60.0,
             ) -> Result:
    """Run one call to the end; errors are returned in the Result, not raised."""
    res = Result()
    md = (("authorization", f"Bearer {token}"),) if token else ()
    with grpc.insecure_channel(address) as channel:
        try:
            for r in pb_grpc.InferenceServiceStub(channel).Generate(req, metadata=md,
                                                                    timeout=timeout):
                if r.HasField("chunk"):
                    res.chunks += 1
                    res.token_ids += list(r.chunk.token_ids)
                    res.text += r.chunk.text
                else:
                    res.complete = r.complete
        except grpc.RpcError as e:
            res.error, res.details = e.code(), e.details() or ""
    return res


def scrape(port: int) -> dict[str, float]:
    """Prometheus text format as {'name{labels}': value}."""
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    out = {}
    for line in text.splitlines():
        m = re.match(r"^([a-zA-Z_:][\w:]*(?:\{[^}]*\})?) ([-+\deE.naif]+)$", line)
        if m:
            out[m.group(1)] = float(m.group(2))
    return out


def scrape_when_idle(port: int, timeout_s: float) -> tuple[bool, dict[str, float]]:
    """Scrape the worker until it runs and queues nothing and holds no KV pages, or until
    `timeout_s`: (whether it got there, the last scrape)."""
    deadline = time.monotonic() + timeout_s
    while True:
        m = scrape(port)
        idle = (m["slora_requests_running"], m["slora_requests_waiting"],
                m['slora_arena_pages{kind="kv"}']) == (0, 0, 0)
        if idle or time.monotonic() > deadline:
            return idle, m
        time.sleep(0.05)


def routing_snapshot(cp_address: str, cluster_token: str, timeout: float = 10.0) -> RoutingTable:
    """The routing table a gateway connecting now (with the cluster token) would receive first."""
    table = RoutingTable()
    done = threading.Event()

    def messages() -> Iterator[ppb.GatewayMessage]:
        yield ppb.GatewayMessage(hello=ppb.GatewayHello(gateway_id="test-observer"))
        done.wait()  # closing our side would end the stream

    with grpc.insecure_channel(cp_address) as channel:
        call = ppb_grpc.PlacementServiceStub(channel).WatchRouting(
            messages(), timeout=timeout, metadata=cluster_metadata(cluster_token))
        try:
            table.apply(next(call))
        finally:
            done.set()
            call.cancel()
    return table
