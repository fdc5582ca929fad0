"""The HTTP API's failure paths on a real stack whose one worker runs one request and queues
one: every error status from a real bad request or condition, in OpenAI's error shape and
raised as the matching `openai` exception; a full worker answers 429 with Retry-After; a client
that goes away (while queued, mid-stream, or waiting for a whole answer) frees the worker's
request and pages; and the raw server-sent-events wire format as `curl -N` sees it."""

from __future__ import annotations

import asyncio
import json
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from openai import OpenAI

from devtools.demo_stack import BASE_MODEL
from services.common.processes import free_port, slora_argv, start_child
from services.worker.debug_hooks import STEP_DELAY_ENV
from tests.services.dataplane.dp_support import PROMPTS, scrape
from tests.services.dataplane.http_support import HttpStack, http_stack, wait_for

pytestmark = pytest.mark.timeout(300)
# One running request and one waiting: a third is refused (429).
WORKER = ("--num-pages", "128", "--max-num-seqs", "1", "--max-queue", "1")
# The demo model decodes 450 tokens in about 0.8 s here, close to what it takes to watch a
# heartbeat reach the gateway: a slow engine (10 ms a step, a test hook) holds the worker full
# for 4.5 s or more, so "one running, one waiting" cannot end while the tests look at it.
SLOW_ENGINE = {STEP_DELAY_ENV: "0.01"}
LONG = {"model": "qv-r4", "prompt": PROMPTS[0], "max_tokens": 450, "ignore_eos": True,
        "temperature": 0}


@pytest.fixture(scope="module")
def hs(demo_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[HttpStack]:
    with http_stack(demo_dir, tmp_path_factory.mktemp("http-errors"), WORKER,
                    SLOW_ENGINE) as running:
        yield running


def post(hs: HttpStack, path: str, body: Any, token: str | None = None,
         raw: bytes | None = None) -> httpx.Response:
    headers = {"authorization": f"Bearer {hs.token if token is None else token}"}
    if raw is not None:
        return httpx.post(hs.url + path, content=raw, headers=headers, timeout=60)
    return httpx.post(hs.url + path, json=body, headers=headers, timeout=60)


def error_of(resp: httpx.Response, status: int, kind: str, words: str) -> dict[str, Any]:
    assert resp.status_code == status, resp.text
    err = resp.json()["error"]
    assert err["type"] == kind and words in err["message"], err
    return err  # type: ignore[no-any-return]


def completion(**fields: Any) -> dict[str, Any]:
    return {"model": "attn-r8", "prompt": PROMPTS[1], "max_tokens": 4, **fields}


def chat(**fields: Any) -> dict[str, Any]:
    return {"model": BASE_MODEL, "messages": [{"role": "user", "content": "Hi"}], **fields}


@pytest.mark.parametrize(("path", "body", "param", "words"), [
    ("/completions", completion(presence_penalty=2.5), "presence_penalty", "less than or equal"),
    ("/completions", completion(frequency_penalty=-3), "frequency_penalty", "greater than"),
    ("/completions", completion(n=17), "n", "n is 17"),
    ("/completions", completion(stop=["a"] * 17), "stop", "at most 16 stop"),
    ("/completions", completion(temperature=3), "temperature", "temperature"),
    ("/completions", completion(prompt=""), "prompt", "prompt must not be empty"),
    ("/completions", completion(logprobs=21), "logprobs", "logprobs is 21; allowed 0..20"),
    ("/completions", completion(max_tokens=0), "max_tokens", "max_tokens must be at least 1"),
    ("/completions", completion(logit_bias={"5": 101}), "logit_bias", "[-100, 100]"),
    ("/completions", completion(logit_bias={"5": -100.5}), "logit_bias", "[-100, 100]"),
    ("/completions", completion(logit_bias={"x": 1}), "logit_bias", "token ids"),
    ("/completions", completion(logit_bias={"-4": 1}), "logit_bias", "out of the vocabulary"),
    ("/completions", completion(best_of=1, n=2), "best_of", "best_of (1) must be >= n (2)"),
    ("/completions", completion(best_of=3, n=1, stream=True), "best_of", "cannot be streamed"),
    ("/completions", completion(prompt_logprobs=21), "prompt_logprobs", "allowed 0..20"),
    ("/completions", completion(stream_options={"include_usage": True}), "stream_options",
     "stream_options"),
    ("/completions", completion(model=BASE_MODEL, adapter_version="v1"), "adapter_version",
     "is the base model"),
    ("/completions", completion(top_p=1.5), "top_p", "top_p"),
    ("/completions", {"prompt": "x"}, "model", "model: Field required"),
    ("/chat/completions", chat(tools=[{"type": "function"}]), "tools[0].function",
     "needs a name"),
    ("/chat/completions", chat(messages=[{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "x"}}]}]), "messages[0].content",
     "only text content parts"),
    ("/chat/completions", chat(top_logprobs=2), "top_logprobs", "top_logprobs needs logprobs"),
    ("/chat/completions", chat(logprobs=True, top_logprobs=21), "top_logprobs",
     "top_logprobs is 21; allowed 0..20"),
    ("/chat/completions", chat(max_tokens=3, max_completion_tokens=3), "max_tokens", "not both"),
    ("/chat/completions", chat(messages=[]), "messages", "messages"),
])
def test_bad_requests_are_400_naming_the_field(hs: HttpStack, path: str, body: dict, param: str,
                                               words: str) -> None:
    err = error_of(post(hs, path, body), 400, "invalid_request_error", words)
    assert err["code"] == "invalid_value" and err["param"] == param, err


@pytest.mark.parametrize(("path", "body", "param", "words"), [
    # only the worker knows the vocabulary and the context length
    ("/completions", completion(logit_bias={"100000": 5}), "logit_bias", "out of the vocabulary"),
    ("/chat/completions", chat(logit_bias={"100000": -5}), "logit_bias", "out of the vocabulary"),
    ("/completions", completion(prompt="word " * 600, echo=True, max_tokens=1), "prompt",
     "max_model_len"),
    ("/completions", completion(max_tokens=5000), "max_tokens", "max_tokens"),
    ("/chat/completions", chat(max_completion_tokens=40000), "max_completion_tokens",
     "max_completion_tokens"),
])
def test_worker_refusals_name_the_field_the_caller_sent(hs: HttpStack, path: str, body: dict,
                                                        param: str, words: str) -> None:
    err = error_of(post(hs, path, body), 400, "invalid_request_error", words)
    assert err["param"] == param and "max_new_tokens" not in err["message"], err
    assert err["code"] in ("invalid_value", "context_length_exceeded"), err


def test_unknown_fields_and_nulls_are_accepted_and_named_in_a_header(hs: HttpStack) -> None:
    resp = post(hs, "/completions", completion(max_token=5, temperature=None, n=None,
                                               stream=None, logprobs=None, echo=None,
                                               extra_body={"frob": 1}))
    assert resp.status_code == 200, resp.text
    assert resp.headers["x-slora-ignored-fields"] == "frob,max_token"
    assert post(hs, "/completions", completion()).headers.get("x-slora-ignored-fields") is None


def test_bad_json_is_400(hs: HttpStack) -> None:
    error_of(post(hs, "/completions", None, raw=b"{not json"), 400, "invalid_request_error",
             "not valid JSON")


def test_the_openai_client_raises_the_matching_errors(hs: HttpStack) -> None:
    good = OpenAI(base_url=hs.url, api_key=hs.token, max_retries=0)
    with pytest.raises(openai.AuthenticationError, match="unknown or revoked API key"):
        OpenAI(base_url=hs.url, api_key="slk_wrong", max_retries=0).completions.create(
            model="qv-r4", prompt="x")
    other = OpenAI(base_url=hs.url, api_key=hs.other_tenant_key(), max_retries=0)
    wait_for(lambda: _authenticates(other), 10, "the new key on the gateway")
    with pytest.raises(openai.PermissionDeniedError, match="may not call adapter 'qv-r4'"):
        other.completions.create(model="qv-r4", prompt="x")
    with pytest.raises(openai.NotFoundError, match="unknown adapter 'no-such'"):
        good.completions.create(model="no-such", prompt="x")
    with pytest.raises(openai.NotFoundError, match="no servable version 'v9'"):
        good.chat.completions.create(model="qv-r4", messages=[{"role": "user", "content": "x"}],
                                     extra_body={"adapter_version": "v9"})
    with pytest.raises(openai.BadRequestError, match="logit_bias") as bad:
        good.chat.completions.create(model="qv-r4", logit_bias={"999999": 1.0},
                                     messages=[{"role": "user", "content": "x"}])
    assert bad.value.param == "logit_bias"  # type: ignore[attr-defined]


def _authenticates(c: OpenAI) -> bool:
    try:
        c.models.list()
        return True
    except openai.AuthenticationError:
        return False


def test_missing_or_malformed_key_is_401_and_unknown_path_404(hs: HttpStack) -> None:
    none = httpx.post(hs.url + "/completions", json=completion())
    error_of(none, 401, "authentication_error", "missing bearer token")
    basic = httpx.post(hs.url + "/completions", json=completion(),
                       headers={"authorization": f"Basic {hs.token}"})
    error_of(basic, 401, "authentication_error", "missing bearer token")
    # 401 comes before the body is looked at
    error_of(post(hs, "/completions", None, token="bad", raw=b"{"), 401, "authentication_error",
             "unknown or revoked")
    error_of(post(hs, "/nope", {}), 404, "not_found_error", "Not Found")


def test_a_gateway_without_its_routing_table_answers_503(hs: HttpStack, tmp_path: Path) -> None:
    http = f"127.0.0.1:{free_port()}"
    lost = start_child("g-lost", slora_argv(
        "gateway", "--control-plane", f"127.0.0.1:{free_port()}", "--listen",
        f"127.0.0.1:{free_port()}", "--http-listen", http, "--gateway-id", "g-lost"), tmp_path)
    try:
        wait_for(lambda: _status(f"http://{http}/health") == 503, 30, "the lost gateway's HTTP")
        resp = httpx.post(f"http://{http}/v1/completions", json=completion(),
                          headers={"authorization": f"Bearer {hs.token}"})
        error_of(resp, 503, "service_unavailable_error", "has not received the routing table")
    finally:
        lost.stop()


def _status(url: str) -> int:
    try:
        return httpx.get(url, timeout=1).status_code
    except httpx.TransportError:
        return 0


def worker_state(hs: HttpStack) -> tuple[float, float, float]:
    m = scrape(hs.worker_metrics)
    return (m["slora_requests_running"], m["slora_requests_waiting"],
            m['slora_arena_pages{kind="kv"}'])


def model_server_metrics(hs: HttpStack) -> tuple[float, float, float]:
    m = scrape(int(hs.url.rsplit(":", 1)[1].removesuffix("/v1")))  # the HTTP port's /metrics
    w = '{worker="w1"}'
    return (m[f"vllm:num_requests_running{w}"], m[f"vllm:num_requests_waiting{w}"],
            m[f"vllm:gpu_cache_usage_perc{w}"])


def idle(hs: HttpStack) -> bool:
    return worker_state(hs) == (0, 0, 0)


def test_full_worker_429_then_disconnects_free_the_queue_and_the_pages(hs: HttpStack) -> None:
    asyncio.run(_full_then_disconnect(hs))
    wait_for(lambda: idle(hs), 5, "the worker idle after the clients left")
    gateway = httpx.get(hs.url.removesuffix("/v1") + "/metrics").text
    assert "slora_gateway_http_disconnects_total 2.0" in gateway
    assert 'slora_gateway_http_requests_total{route="completions",status="429"} 1.0' in gateway


async def _full_then_disconnect(hs: HttpStack) -> None:
    headers = {"authorization": f"Bearer {hs.token}"}
    async with (httpx.AsyncClient(base_url=hs.url, headers=headers, timeout=60) as h,
                h.stream("POST", "/completions", json={**LONG, "stream": True}) as running):
        assert running.status_code == 200
        lines = running.aiter_lines()
        assert (await anext(lines)).startswith("data: {")
        # the second waits in the worker's queue; its client gives up while it waits
        queued = asyncio.create_task(h.post("/completions", json=LONG))
        await asyncio.to_thread(wait_for, lambda: worker_state(hs)[:2] == (1, 1), 10,
                                "one running and one waiting request")
        # the gateway shows the worker's figures as the Inference Extension reads them
        await asyncio.to_thread(wait_for, lambda: model_server_metrics(hs)[:2] == (1, 1), 5,
                                "the worker's heartbeat figures on the gateway")
        assert 0 < model_server_metrics(hs)[2] <= 1
        gateway = httpx.get(hs.url.removesuffix("/v1") + "/metrics").text
        assert 'running_lora_adapters="qv-r4",waiting_lora_adapters="qv-r4"' in gateway
        full = await h.post("/completions", json=completion(model="qv-r4"))
        error_of(full, 429, "rate_limit_error", "every worker is busy")
        assert int(full.headers["retry-after"]) >= 1
        queued.cancel()
        await asyncio.to_thread(wait_for, lambda: worker_state(hs)[:2] == (1, 0), 5,
                                "the queued request dropped")
        running_kv = worker_state(hs)[2]
        assert running_kv > 0
    # leaving the block closes the stream mid-generation: a disconnect


def test_a_non_streamed_request_whose_client_times_out_is_cancelled(hs: HttpStack) -> None:
    # 450 decode steps take 4.5 s or more (SLOW_ENGINE), far over the client's 0.25 s.
    with pytest.raises(httpx.ReadTimeout):
        post_long = httpx.post(hs.url + "/completions", json=LONG, timeout=0.25,
                               headers={"authorization": f"Bearer {hs.token}"})
        raise AssertionError(f"450 tokens within 0.25 s: {post_long.status_code}")
    wait_for(lambda: idle(hs), 5, "the worker idle after the client timed out")


def test_raw_sse_wire_format_with_curl(hs: HttpStack) -> None:
    if shutil.which("curl") is None:
        pytest.skip("curl is not installed")
    body = json.dumps({**completion(model="qv-r4"), "stream": True, "temperature": 0,
                       "stream_options": {"include_usage": True}})
    out = subprocess.run(
        ["curl", "-N", "-sS", "-i", "--max-time", "60", hs.url + "/completions",
         "-H", f"Authorization: Bearer {hs.token}", "-H", "Content-Type: application/json",
         "-d", body], capture_output=True, text=True, check=True).stdout
    head, _, stream = out.replace("\r\n", "\n").partition("\n\n")
    assert head.startswith("HTTP/1.1 200") and "content-type: text/event-stream" in head.lower()
    assert "x-slora-served-by: qv-r4@v1; worker=w1" in head.lower()
    events = stream.split("\n\n")
    assert events[-1] == "" and events[-2] == "data: [DONE]"
    payloads = [json.loads(e.removeprefix("data: ")) for e in events[:-2]]
    assert all(e.startswith("data: ") and "\n" not in e for e in events[:-1])
    *chunks, usage = payloads
    assert usage["choices"] == [] and usage["usage"]["completion_tokens"] == 4
    assert [c["choices"][0]["finish_reason"] for c in chunks][-1] == "length"
    assert {c["id"] for c in payloads} == {payloads[0]["id"]}
    assert all(c["object"] == "text_completion" and c["usage"] is None for c in chunks)
