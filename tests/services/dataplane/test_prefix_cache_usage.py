"""Prefix caching as clients and dashboards see it: a conversation's later turns report the
prompt tokens the worker's prefix cache served (OpenAI's usage.prompt_tokens_details
.cached_tokens over HTTP, Usage.cached_tokens over gRPC), its first turn none, and the worker
that served it counts the lookups and hits in vLLM's vllm:prefix_cache_queries/_hits.

Real processes on loopback: a control plane, two CPU workers and a gateway. Sequential calls
for one adapter version go to the same worker (the gateway orders candidates by assignment,
in-flight calls, then worker id); each turn's worker is read back from x-slora-served-by /
served_by, and cached tokens are asserted on turns served where the earlier turn was."""

from __future__ import annotations

import secrets
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from devtools.demo_stack import Stack, StackConfig, publish_demo_adapters, wait_until_routable
from services.common.processes import free_port, wait_serving
from services.control_plane.api.client import AdminClient
from services.gateway.openai_responses import ChoiceState, usage_json
from services.worker.main import publish_state
from services.worker.metrics import WorkerMetrics
from slora.v1 import inference_pb2 as pb
from tests.services.dataplane.dp_support import generate, scrape

ADAPTER = "qv-r4"
pytestmark = pytest.mark.timeout(300)


def complete(index: int, prompt: int, cached: int) -> ChoiceState:
    c = ChoiceState(index)
    c.add(pb.GenerateResponse(complete=pb.Complete(usage=pb.Usage(
        prompt_tokens=prompt, completion_tokens=2, cached_tokens=cached))))
    return c


def test_usage_details_count_each_prompt_once_and_wait_for_the_end() -> None:
    # n=2 samples of two prompts: choices 0, 1 share prompt 0; 2, 3 prompt 1.
    choices = [complete(0, 40, 32), complete(1, 40, 32), complete(2, 30, 0), complete(3, 30, 16)]
    usage = usage_json(choices, 2)
    assert usage["prompt_tokens"] == 70
    assert usage["prompt_tokens_details"] == {"cached_tokens": 32}
    running = ChoiceState(0)
    running.add(pb.GenerateResponse(chunk=pb.Chunk(text="a", token_ids=[5], prompt_tokens=40)))
    # Mid-stream (continuous usage stats) the cached share is not known yet: left out.
    assert "prompt_tokens_details" not in usage_json([running], 1)
    assert usage_json([complete(0, 40, 0)], 1)["prompt_tokens_details"] == {"cached_tokens": 0}


class Running:
    def __init__(self, stack: Stack, token: str, metrics: dict[str, int]) -> None:
        self.stack, self.token, self.metrics = stack, token, metrics

    @property
    def url(self) -> str:
        return self.stack.http_urls["g1"]


@pytest.fixture(scope="module")
def running(demo_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Running]:
    state = tmp_path_factory.mktemp("stack")
    stack = Stack(StackConfig(demo_dir=demo_dir, state_dir=state, heartbeat_s=0.5))
    metrics = {"w1": free_port(), "w2": free_port()}
    try:
        stack.start_control_plane()
        for name in ("w1", "w2"):
            stack.start_worker(name, wait=False, extra=("--metrics-port", str(metrics[name])))
        stack.start_gateway("g1", wait=False)
        admin = AdminClient.connect(stack.cp_address, stack.admin_token)
        token = publish_demo_adapters(admin, demo_dir, (ADAPTER,))
        for name, child in stack.workers.items():
            wait_serving(stack.worker_addresses[name], child, timeout_s=120)
        wait_until_routable(stack.gateway_addresses["g1"], token, (ADAPTER,), timeout_s=120)
        yield Running(stack, token, metrics)
    finally:
        stack.stop()


def system_prompt() -> str:
    """Long enough to fill several KV pages; a fresh nonce so nothing earlier shares it."""
    facts = " ".join(f"Fact {i}: the festival's stage {i} opens at {i + 8} o'clock." for i in
                     range(2))
    return f"Session {secrets.token_hex(4)}. You answer briefly. {facts}"


def post(r: Running, path: str, body: dict[str, Any]) -> tuple[str, httpx.Response]:
    """The response and the worker that served it (from x-slora-served-by)."""
    res = httpx.post(f"{r.url}/{path}", json=body, timeout=60,
                     headers={"authorization": f"Bearer {r.token}"})
    assert res.status_code == 200, res.text
    worker = res.headers["x-slora-served-by"].split("worker=")[1].split(";")[0]
    return worker, res


def cached_of(usage: dict[str, Any]) -> int:
    return int(usage["prompt_tokens_details"]["cached_tokens"])


@pytest.mark.slow  # two CPU workers start (~30-60 s on a shared 2-core host)
def test_a_conversations_later_turns_report_cached_prompt_tokens(running: Running) -> None:
    hits_before = {w: scrape(p).get("vllm:prefix_cache_hits_total", 0.0)
                   for w, p in running.metrics.items()}
    messages: list[dict[str, str]] = [{"role": "system", "content": system_prompt()}]
    served: list[tuple[str, int, int]] = []  # (worker, prompt tokens, cached tokens) per turn
    for turn in range(3):
        messages.append({"role": "user", "content": f"Which stage opens at {9 + turn}?"})
        worker, res = post(running, "chat/completions", {
            "model": ADAPTER, "messages": messages, "max_tokens": 3, "temperature": 0})
        body = res.json()
        usage = body["usage"]
        served.append((worker, usage["prompt_tokens"], cached_of(usage)))
        messages.append({"role": "assistant", "content": body["choices"][0]["message"]["content"]})
    assert served[0][2] == 0, served  # the first turn: nothing of this conversation was cached
    later = [s for prev, s in zip(served, served[1:], strict=False) if s[0] == prev[0]]
    assert later, f"no two consecutive turns on one worker: {served}"
    for _, prompt, cached in later:
        # The earlier turns' whole pages come from the cache; the new turn's tail does not.
        assert 0 < cached < prompt, served

    # Streamed, with the usage event at the end: the same conversation once more.
    messages.append({"role": "user", "content": "And stage 3?"})
    body = {"model": ADAPTER, "messages": messages, "max_tokens": 3, "temperature": 0,
            "stream": True, "stream_options": {"include_usage": True}}
    with httpx.stream("POST", f"{running.url}/chat/completions", json=body, timeout=60,
                      headers={"authorization": f"Bearer {running.token}"}) as res:
        assert res.status_code == 200
        worker = res.headers["x-slora-served-by"].split("worker=")[1].split(";")[0]
        events = [line[6:] for line in res.iter_lines() if line.startswith("data: {")]
    usage = httpx.Response(200, content=events[-1]).json()["usage"]
    if worker == served[-1][0]:
        assert 0 < cached_of(usage) < usage["prompt_tokens"]

    # /v1/completions: the same text prompt twice.
    text = system_prompt()
    firsts = [post(running, "completions", {"model": ADAPTER, "prompt": text, "max_tokens": 2,
                                            "temperature": 0}) for _ in range(2)]
    (w1, first), (w2, second) = firsts
    assert cached_of(first.json()["usage"]) == 0
    if w1 == w2:
        assert 0 < cached_of(second.json()["usage"]) <= second.json()["usage"]["prompt_tokens"]

    # gRPC: the same text prompt again reports its cached tokens in Complete.usage.
    out = generate(running.stack.gateway_addresses["g1"], pb.GenerateRequest(
        text=text, adapter=pb.AdapterRef(adapter_id=ADAPTER),
        sampling=pb.SamplingOptions(max_new_tokens=2, temperature=0)), running.token)
    assert out.error is None and out.complete is not None, out.details
    if out.complete.served_by.worker_id == w2:
        assert 0 < out.complete.usage.cached_tokens <= out.complete.usage.prompt_tokens

    # The worker that served the conversation counted the hits in vLLM's families.
    w = served[-1][0]
    after = scrape(running.metrics[w])
    assert after["vllm:prefix_cache_hits_total"] > hits_before[w]
    assert after["vllm:prefix_cache_queries_total"] >= after["vllm:prefix_cache_hits_total"]


def test_the_core_sends_cached_tokens_once_and_the_front_keeps_them(
        demo_dir: Path, tmp_path: Path) -> None:
    """A real engine behind the engine-core loop (no process): the first request of a prompt
    reports none cached, a second of the same prompt its whole pages, once, with its first
    tokens; the state carries the engine's lookups and hits; the front's stream keeps it."""
    from services.worker import core_protocol as m
    from services.worker.core_client import CoreClient, TokenStream
    from services.worker.engine_core import EngineCore
    from slora_core.config import EngineConfig
    from slora_core.engine import LLMEngine
    from slora_core.sampling_params import SamplingParams

    engine = LLMEngine.from_model_dir(demo_dir / "model", EngineConfig(
        num_pages=64, block_size=16, max_rank=16))
    core = EngineCore(engine, outputs=None, parent_pid=0)  # type: ignore[arg-type]
    sampling = m.SamplingMsg.of(SamplingParams(max_new_tokens=3, temperature=0.0))
    prompt = [(7 * i) % 200 + 3 for i in range(40)]  # two whole 16-token pages and a tail

    def serve(rid: int) -> list[m.StepOutput]:
        core._add(m.AddRequest(rid, prompt, sampling))
        outs = []
        while engine.has_unfinished():
            outs.append(core._step_output(engine.step()))
        return outs

    first, second = serve(1), serve(2)
    assert [c for out in first for c in out.cached] == []
    assert [c for out in second for c in out.cached] == [(2, 32)]
    assert second[-1].state.prefix_cache_hits == 32
    assert second[-1].state.prefix_cache_queries >= 2 * len(prompt)
    client = CoreClient(demo_dir / "model", EngineConfig())
    try:
        stream = client.streams[2] = TokenStream()
        for out in second:
            client._dispatch(out)
    finally:
        client._ctx.term()
        client._sync_ctx.term()
        client._dir.cleanup()
    assert stream.cached_tokens == 32 and stream.finish is not None
    metrics = WorkerMetrics()
    for out in (*first, *second):
        publish_state(metrics, out)
    totals = {s.name: s.value for f in text_string_to_metric_families(
        generate_latest(metrics.registry).decode()) for s in f.samples
        if s.name.startswith("vllm:prefix") and s.name.endswith("_total")}
    assert totals == {"vllm:prefix_cache_queries_total": second[-1].state.prefix_cache_queries,
                      "vllm:prefix_cache_hits_total": 32}
