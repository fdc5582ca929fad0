"""The gateway's OpenAI-compatible HTTP API on a real stack (control plane, CPU worker,
gateway), called with the official `openai` client, sync and async, streaming and not, and
checked against gRPC `Generate` on the same gateway: same greedy tokens, same canary
stickiness per routing key, and a rollback seen through HTTP within a second."""

from __future__ import annotations

import asyncio
import json
import subprocess
import time
from pathlib import Path

import httpx
import openai
import pytest
from openai import AsyncOpenAI, OpenAI

from devtools.demo_stack import BASE_MODEL
from services.common.processes import slora_argv
from services.gateway.table import canary_share
from slora.v1 import inference_pb2 as pb
from tests.services.dataplane.dp_support import PROMPTS, Result, generate, request
from tests.services.dataplane.http_support import (
    ADAPTERS,
    MODELS,
    HttpStack,
    wait_for,
)

pytestmark = pytest.mark.timeout(300)
CHAT = [{"role": "system", "content": "Answer briefly."},
        {"role": "user", "content": "The quick brown fox"}]


@pytest.fixture(scope="module")
def hs(shared_http_stack: HttpStack) -> HttpStack:
    return shared_http_stack  # tests/services/conftest.py


@pytest.fixture(scope="module")
def client(hs: HttpStack) -> OpenAI:
    return OpenAI(base_url=hs.url, api_key=hs.token, max_retries=0)


def adapter_of(model: str) -> str:
    return "" if model == BASE_MODEL else model


def fingerprint(model: str, version: str = "v1") -> str:
    return model if model == BASE_MODEL else f"{model}@{version}"


def grpc_greedy(hs: HttpStack, prompt: str, model: str, tokens: int = 8) -> Result:
    res = generate(hs.grpc, request(prompt, adapter_of(model), max_new_tokens=tokens,
                                    temperature=0), hs.token)
    assert res.error is None and res.complete is not None, res.details
    return res


def has_chat_template(demo_dir: Path) -> bool:
    config = json.loads((demo_dir / "model" / "tokenizer_config.json").read_text())
    return bool(config.get("chat_template")) or (demo_dir / "model" / "chat_template.jinja").exists()


@pytest.mark.parametrize("model", MODELS)
def test_completions_equal_grpc_greedy_tokens(hs: HttpStack, client: OpenAI, model: str) -> None:
    ref = grpc_greedy(hs, PROMPTS[1], model)
    raw = client.completions.with_raw_response.create(
        model=model, prompt=PROMPTS[1], max_tokens=8, temperature=0, logprobs=0)
    r = raw.parse()
    choice = r.choices[0]
    assert choice.logprobs is not None and choice.logprobs.tokens is not None
    assert choice.logprobs.tokens == hs.texts(ref.token_ids)
    assert choice.text == ref.text
    assert choice.finish_reason == ref.complete.finish_reason  # type: ignore[union-attr]
    assert r.usage is not None and r.usage.completion_tokens == len(ref.token_ids)
    assert r.usage.prompt_tokens == ref.complete.usage.prompt_tokens  # type: ignore[union-attr]
    assert r.system_fingerprint == fingerprint(model) and r.object == "text_completion"
    assert raw.headers["x-slora-served-by"] == f"{fingerprint(model)}; worker=w1"


@pytest.mark.parametrize("model", MODELS)
def test_streamed_completion_with_usage_equals_grpc(hs: HttpStack, client: OpenAI,
                                                    model: str) -> None:
    ref = grpc_greedy(hs, PROMPTS[0], model)
    stream = client.completions.create(model=model, prompt=PROMPTS[0], max_tokens=8,
                                       temperature=0, logprobs=0, stream=True,
                                       stream_options={"include_usage": True})
    events = list(stream)
    *chunks, last = events
    assert last.choices == [] and last.usage is not None
    assert last.usage.completion_tokens == len(ref.token_ids)
    assert all(c.usage is None for c in chunks)
    text = "".join(c.choices[0].text for c in chunks)
    tokens = [t for c in chunks if c.choices[0].logprobs
              for t in c.choices[0].logprobs.tokens or []]
    assert (text, tokens) == (ref.text, hs.texts(ref.token_ids))
    assert chunks[-1].choices[0].finish_reason == ref.complete.finish_reason  # type: ignore[union-attr]


@pytest.mark.slow  # HTTP = gRPC (default) and gRPC = slora batch (test_stack_e2e) imply it
def test_completions_equal_slora_batch(hs: HttpStack, client: OpenAI, demo_dir: Path,
                                       tmp_path: Path) -> None:
    items = [{"prompt": p, "max_new_tokens": 7, "temperature": 0,
              **({"adapter": adapter_of(m)} if adapter_of(m) else {})}
             for m in MODELS for p in PROMPTS[:2]]
    (tmp_path / "in.jsonl").write_text("".join(json.dumps(i) + "\n" for i in items))
    subprocess.run(slora_argv(
        "batch", "--model", str(demo_dir / "model"), "--input", str(tmp_path / "in.jsonl"),
        "--output", str(tmp_path / "out.jsonl"), "--no-progress",
        *[f"--adapter={a}={demo_dir / 'adapters' / a}" for a in ADAPTERS]),
        check=True, timeout=120)
    expected = [json.loads(line) for line in (tmp_path / "out.jsonl").read_text().splitlines()]
    for item, want in zip(items, expected, strict=True):
        r = client.completions.create(model=str(item.get("adapter", BASE_MODEL)),
                                      prompt=str(item["prompt"]), max_tokens=7, temperature=0,
                                      logprobs=0)
        got = r.choices[0]
        assert got.logprobs is not None and got.logprobs.tokens is not None
        assert (got.logprobs.tokens, got.text, got.finish_reason) == (
            hs.texts(want["token_ids"]), want["text"], want["finish_reason"])


def test_prompt_as_token_ids_and_several_prompts(hs: HttpStack, client: OpenAI) -> None:
    ref = [grpc_greedy(hs, p, "qv-r4", 5) for p in PROMPTS[:2]]
    by_ids = client.completions.create(model="qv-r4", prompt=ref[0].token_ids, max_tokens=5,
                                       temperature=0, logprobs=0)
    grpc_ids = generate(hs.grpc, pb.GenerateRequest(
        token_ids=pb.TokenIds(ids=ref[0].token_ids), adapter=pb.AdapterRef(adapter_id="qv-r4"),
        sampling=pb.SamplingOptions(max_new_tokens=5, temperature=0)), hs.token)
    assert by_ids.choices[0].logprobs.tokens == hs.texts(grpc_ids.token_ids)  # type: ignore[union-attr]
    both = client.completions.create(model="qv-r4", prompt=list(PROMPTS[:2]), max_tokens=5,
                                      temperature=0)
    assert [c.text for c in sorted(both.choices, key=lambda c: c.index)] == [r.text for r in ref]
    prompt_tokens = sum(r.complete.usage.prompt_tokens for r in ref)  # type: ignore[union-attr]
    assert both.usage is not None and both.usage.prompt_tokens == prompt_tokens


def test_n_samples(client: OpenAI) -> None:
    r = client.completions.create(model="attn-r8", prompt=PROMPTS[2], max_tokens=6, n=3,
                                  temperature=1.0, seed=7)
    assert sorted(c.index for c in r.choices) == [0, 1, 2]
    assert r.usage is not None and r.usage.completion_tokens == 18
    assert len({c.text for c in r.choices}) > 1  # seeds 7, 8, 9: different samples
    again = client.completions.create(model="attn-r8", prompt=PROMPTS[2], max_tokens=6, n=3,
                                      temperature=1.0, seed=7)
    assert [c.text for c in again.choices] == [c.text for c in r.choices]  # reproducible
    scored = httpx.post(f"{client.base_url}feedback", json={"request_id": r.id, "score": 1},
                        headers={"authorization": f"Bearer {client.api_key}"})
    assert scored.status_code == 200, scored.text  # the response's id names all n choices
    with pytest.raises(openai.BadRequestError, match="n is 17"):
        client.completions.create(model="attn-r8", prompt=PROMPTS[2], n=17)


def grpc_chat(hs: HttpStack, model: str, tokens: int) -> Result:
    return generate(hs.grpc, pb.GenerateRequest(
        messages=[pb.ChatMessage(**m) for m in CHAT], adapter=pb.AdapterRef(
            adapter_id=adapter_of(model)),
        sampling=pb.SamplingOptions(max_new_tokens=tokens, temperature=0)), hs.token)


@pytest.mark.parametrize("model", MODELS)
def test_chat_equals_grpc_chat(hs: HttpStack, client: OpenAI, demo_dir: Path,
                               model: str) -> None:
    assert has_chat_template(demo_dir)  # the demo model ships one
    ref = grpc_chat(hs, model, 6)
    assert ref.error is None, ref.details
    r = client.chat.completions.create(model=model, messages=CHAT, max_tokens=6,  # type: ignore[arg-type]
                                       temperature=0, logprobs=True, top_logprobs=2)
    choice = r.choices[0]
    assert choice.message.role == "assistant" and choice.message.content == ref.text
    assert choice.logprobs is not None and choice.logprobs.content is not None
    assert [t.token for t in choice.logprobs.content] == hs.texts(ref.token_ids)
    assert [bytes(t.bytes or []).decode("utf-8", "replace") for t in choice.logprobs.content] == [
        t.token for t in choice.logprobs.content]
    assert all(len(t.top_logprobs) == 2 for t in choice.logprobs.content)
    assert r.object == "chat.completion" and r.system_fingerprint == fingerprint(model)
    stream = client.chat.completions.create(model=model, messages=CHAT, max_tokens=6,  # type: ignore[arg-type]
                                            temperature=0, stream=True)
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == ref.text


def test_async_client_streams_and_not_concurrently(hs: HttpStack) -> None:
    refs = {m: grpc_greedy(hs, PROMPTS[2], m, 10) for m in MODELS}

    async def one(c: AsyncOpenAI, model: str, stream: bool) -> str:
        if not stream:
            r = await c.completions.create(model=model, prompt=PROMPTS[2], max_tokens=10,
                                           temperature=0)
            return r.choices[0].text
        s = await c.completions.create(model=model, prompt=PROMPTS[2], max_tokens=10,
                                       temperature=0, stream=True)
        return "".join([chunk.choices[0].text async for chunk in s])

    async def main() -> list[str]:
        async with AsyncOpenAI(base_url=hs.url, api_key=hs.token, max_retries=0) as c:
            return await asyncio.gather(*(one(c, m, s) for m in MODELS for s in (False, True)))

    got = asyncio.run(main())
    assert got == [refs[m].text for m in MODELS for _ in (False, True)]


def test_models_lists_base_and_the_keys_adapters(hs: HttpStack, client: OpenAI) -> None:
    models = {m.id: m for m in client.models.list()}
    assert set(models) == {BASE_MODEL, *ADAPTERS}
    assert models["qv-r4"].model_extra["stable_version"] == "v1"  # type: ignore[index]
    assert models["qv-r4"].model_extra["parent"] == BASE_MODEL  # type: ignore[index]
    assert client.models.retrieve("attn-r8").id == "attn-r8"
    with pytest.raises(openai.NotFoundError, match="unknown model 'nope'"):
        client.models.retrieve("nope")
    other = OpenAI(base_url=hs.url, api_key=hs.other_tenant_key(), max_retries=0)
    # a new key reaches the gateway with the next routing update
    wait_for(lambda: _lists(other) is not None, 10, "the other tenant's key on the gateway")
    assert _lists(other) == [BASE_MODEL]
    with pytest.raises(openai.NotFoundError):  # another tenant's adapter is not shown either
        other.models.retrieve("qv-r4")


def _lists(c: OpenAI) -> list[str] | None:
    try:
        return [m.id for m in c.models.list()]
    except openai.AuthenticationError:
        return None


def served_version(hs: HttpStack, client: OpenAI, key: str, how: str) -> str:
    """The version of qv-r4 that serves routing key `key`, asked through `how`."""
    if how == "grpc":
        res = generate(hs.grpc, request(PROMPTS[0], "qv-r4", routing_key=key,
                                        max_new_tokens=1, temperature=0), hs.token)
        assert res.complete is not None, res.details
        return res.complete.served_by.adapter_version
    extra = {"user": key} if how == "user" else {"extra_body": {"routing_key": key}}
    r = client.completions.create(model="qv-r4", prompt=PROMPTS[0], max_tokens=1,
                                  temperature=0, **extra)  # type: ignore[arg-type]
    assert r.system_fingerprint is not None
    return r.system_fingerprint.split("@", 1)[1]


def test_canary_is_as_sticky_over_http_as_over_grpc_and_a_rollback_shows_within_1s(
        hs: HttpStack, client: OpenAI) -> None:
    hs.register("qv-r4", "v2", hs.upload("qv-r4-v2", "qv-r4"))
    hs.admin.canary("qv-r4", "v2", 0.5)
    keys = [f"user-{i}" for i in range(12)]
    expected = {k: "v2" if canary_share("qv-r4", k) < 0.5 else "v1" for k in keys}
    assert set(expected.values()) == {"v1", "v2"}
    on_canary = next(k for k in keys if expected[k] == "v2")
    wait_for(lambda: served_version(hs, client, on_canary, "routing_key") == "v2", 10,
             "the canary on the gateway")
    for how in ("grpc", "user", "routing_key"):
        assert {k: served_version(hs, client, k, how) for k in keys} == expected, how
    pinned = client.completions.create(model="qv-r4", prompt=PROMPTS[0], max_tokens=1,
                                       extra_body={"adapter_version": "v1",
                                                   "routing_key": on_canary})
    assert pinned.system_fingerprint == "qv-r4@v1"
    hs.admin.rollback("qv-r4", reason="test: rollback seen over HTTP")
    start = time.monotonic()
    wait_for(lambda: served_version(hs, client, on_canary, "user") == "v1", 5, "the rollback")
    assert time.monotonic() - start < 1.0


def test_feedback_reaches_the_served_version(hs: HttpStack, client: OpenAI) -> None:
    r = client.completions.create(model="attn-r8", prompt=PROMPTS[0], max_tokens=2)
    url = f"{hs.url}/feedback"
    auth = {"authorization": f"Bearer {hs.token}"}
    ok = httpx.post(url, json={"request_id": r.id, "score": 0.5, "labels": {"k": "v"}},
                    headers=auth)
    assert ok.status_code == 200 and ok.json()["request_id"] == r.id
    again = httpx.post(url, json={"request_id": r.id, "score": 0.5}, headers=auth)
    assert again.status_code == 409 and again.json()["error"]["code"] == "already_exists"
    unknown = httpx.post(url, json={"request_id": "cmpl-unknown", "score": 0}, headers=auth)
    assert unknown.status_code == 404
    out_of_range = httpx.post(url, json={"request_id": r.id, "score": 2}, headers=auth)
    assert out_of_range.status_code == 400 and "score" in out_of_range.json()["error"]["message"]


@pytest.mark.slow  # fills a 512-token context; nulls: test_openai_convert
def test_explicit_nulls_mean_defaults_and_chat_fills_the_context(client: OpenAI) -> None:
    r = client.chat.completions.create(  # type: ignore[call-overload]
        model="qv-r4", messages=CHAT, n=None, stream=None, logprobs=None, top_logprobs=None,
        temperature=0, max_tokens=None, stop=None, presence_penalty=None, seed=None,
        frequency_penalty=None, logit_bias=None, user=None, top_p=None, stream_options=None,
        extra_body={"ignore_eos": True, "min_tokens": None, "top_k": None})
    assert r.choices[0].finish_reason == "length"
    assert r.usage is not None and r.usage.prompt_tokens + r.usage.completion_tokens == 512
    assert r.usage.completion_tokens > 64  # was cut at 64 without max_tokens


def test_max_completion_tokens_on_both_endpoints(client: OpenAI) -> None:
    c = client.completions.create(model="qv-r4", prompt=PROMPTS[0], temperature=0,
                                  extra_body={"max_completion_tokens": 3, "ignore_eos": True})
    chat = client.chat.completions.create(model="qv-r4", messages=CHAT, temperature=0,  # type: ignore[arg-type]
                                          max_completion_tokens=3,
                                          extra_body={"ignore_eos": True})
    assert c.usage is not None and chat.usage is not None
    assert c.usage.completion_tokens == chat.usage.completion_tokens == 3


def test_continuous_usage_stats_put_usage_on_every_chunk(client: OpenAI) -> None:
    stream = client.completions.create(
        model="attn-r8", prompt=PROMPTS[1], max_tokens=6, temperature=0, stream=True,
        stream_options={"include_usage": True, "continuous_usage_stats": True},  # type: ignore[typeddict-unknown-key]
        extra_body={"ignore_eos": True})
    chunks = list(stream)
    assert all(c.usage is not None for c in chunks)
    counts = [c.usage.completion_tokens for c in chunks if c.usage is not None]
    assert counts == sorted(counts) and counts[-1] == 6
    assert len({c.usage.prompt_tokens for c in chunks if c.usage is not None}) == 1


def test_logit_bias_and_min_p_reach_the_sampler(hs: HttpStack, client: OpenAI) -> None:
    ref = grpc_greedy(hs, PROMPTS[0], "qv-r4", 6)
    forced = ref.token_ids[0] + 1
    r = client.completions.create(model="qv-r4", prompt=PROMPTS[0], max_tokens=6,
                                  temperature=0, logprobs=0, logit_bias={str(forced): 100},
                                  extra_body={"ignore_eos": True})
    assert r.choices[0].logprobs.tokens == hs.texts([forced] * 6)  # type: ignore[union-attr]
    # min_p 1 keeps only the most likely token: sampling at any temperature is greedy
    sampled = client.completions.create(model="qv-r4", prompt=PROMPTS[0], max_tokens=6,
                                        temperature=1.5, seed=3, extra_body={"min_p": 1.0})
    assert sampled.choices[0].text == ref.text


def test_best_of_keeps_the_most_likely_samples(client: OpenAI) -> None:
    args = {"model": "attn-r8", "prompt": PROMPTS[2], "max_tokens": 5, "temperature": 1.0,
            "seed": 11, "logprobs": 0}
    every = client.completions.create(n=3, **args)  # type: ignore[call-overload]
    scores = {c.text: sum(c.logprobs.token_logprobs) for c in every.choices}
    best = client.completions.create(n=1, best_of=3, **args)  # type: ignore[call-overload]
    assert [c.index for c in best.choices] == [0]
    assert best.choices[0].text == max(scores, key=scores.__getitem__)
    assert best.usage is not None and best.usage.completion_tokens == 15  # all 3 were run


def test_echo_include_stop_str_and_named_messages(hs: HttpStack, client: OpenAI) -> None:
    ref = grpc_greedy(hs, PROMPTS[0], "qv-r4", 8)
    echoed = client.completions.create(model="qv-r4", prompt=PROMPTS[0], max_tokens=8,
                                       temperature=0, echo=True)
    assert echoed.choices[0].text == PROMPTS[0] + ref.text
    stop = ref.text.strip()[-2:]
    kept = client.completions.create(model="qv-r4", prompt=PROMPTS[0], max_tokens=8,
                                     temperature=0, stop=[stop],
                                     extra_body={"include_stop_str_in_output": True})
    assert kept.choices[0].text.endswith(stop) and kept.choices[0].finish_reason == "stop"
    named = client.chat.completions.create(model="qv-r4", max_tokens=2, messages=[  # type: ignore[list-item]
        {"role": "system", "content": "Be brief.", "name": "rules"},
        {"role": "user", "content": "Hi", "name": "alice"}])
    assert named.choices[0].message.role == "assistant"


def test_echo_with_logprobs_returns_the_prompts_logprobs(hs: HttpStack, client: OpenAI) -> None:
    ids = grpc_greedy(hs, PROMPTS[1], "qv-r4", 1)  # for the prompt's length
    prompt_len = ids.complete.usage.prompt_tokens  # type: ignore[union-attr]
    r = client.completions.create(model="qv-r4", prompt=PROMPTS[1], max_tokens=0, echo=True,
                                  logprobs=2, extra_body={"prompt_logprobs": 2})
    choice = r.choices[0]
    lps = choice.logprobs
    assert choice.text == PROMPTS[1] and r.usage is not None and r.usage.completion_tokens == 0
    assert lps is not None and lps.token_logprobs is not None and lps.top_logprobs is not None
    assert len(lps.token_logprobs) == prompt_len and lps.token_logprobs[0] is None
    assert all(lp is not None and lp <= 0 for lp in lps.token_logprobs[1:])
    # two alternatives each (fewer where two tokens read the same text: a dict by text)
    assert all(1 <= len(top) <= 2 for top in lps.top_logprobs[1:])
    assert max(len(top) for top in lps.top_logprobs[1:]) == 2
    assert lps.text_offset is not None and lps.text_offset[0] == 0
    assert "".join(lps.tokens or []).endswith(PROMPTS[1])  # the BOS token's text first
    extra = choice.model_extra["prompt_logprobs"]  # type: ignore[index]
    assert extra[0] is None and len(extra) == prompt_len
    for entry, lp in zip(extra[1:], lps.token_logprobs[1:], strict=True):
        assert any(abs(v["logprob"] - lp) < 1e-9 for v in entry.values())
    # with a generated token: the prompt's logprobs, then the token's
    more = client.completions.create(model="qv-r4", prompt=PROMPTS[1], max_tokens=2, echo=True,
                                     logprobs=0, temperature=0)
    more_lps = more.choices[0].logprobs.token_logprobs  # type: ignore[union-attr]
    assert more_lps is not None and len(more_lps) == prompt_len + 2
    assert all(abs(a - b) < 1e-6 for a, b in zip(more_lps[1:prompt_len],  # type: ignore[operator]
                                                   lps.token_logprobs[1:], strict=True))


def test_the_workers_metrics_carry_vllms_router_families(hs: HttpStack, client: OpenAI) -> None:
    from prometheus_client.parser import text_string_to_metric_families

    client.completions.create(model="qv-r4", prompt=PROMPTS[0], max_tokens=2)
    text = httpx.get(f"http://127.0.0.1:{hs.worker_metrics}/metrics", timeout=5).text
    families = {f.name: f.samples for f in text_string_to_metric_families(text)}
    for name in ("vllm:num_requests_waiting", "vllm:num_requests_running",
                 "vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc",
                 "vllm:num_gpu_loaded_lora_adapters", "vllm:max_gpu_lora_adapters"):
        assert len(families[name]) == 1 and families[name][0].labels == {}, name
    info = families["vllm:lora_requests_info"][0].labels
    assert set(info) == {"max_lora", "running_lora_adapters", "waiting_lora_adapters"}
    assert int(info["max_lora"]) >= 1
    cache = families["vllm:cache_config_info"][0].labels
    assert int(cache["num_gpu_blocks"]) == 128 and int(cache["block_size"]) > 0
    assert families["vllm:lora_adapter_loaded"]  # the adapter just served is warm
    assert any(s.name == "vllm:time_to_first_token_seconds_count" and s.value >= 1
               for s in families["vllm:time_to_first_token_seconds"])


def test_frequency_penalty_changes_greedy_output_and_version_answers(hs: HttpStack,
                                                                    client: OpenAI) -> None:
    args = {"model": "qv-r4", "prompt": PROMPTS[2], "max_tokens": 24, "temperature": 0,
            "logprobs": 0, "extra_body": {"ignore_eos": True}}
    plain = client.completions.create(**args)  # type: ignore[call-overload]
    tokens = plain.choices[0].logprobs.tokens
    assert len(set(tokens)) < len(tokens)  # greedy repeats itself on the demo model
    penalised = client.completions.create(frequency_penalty=2.0, presence_penalty=2.0, **args)  # type: ignore[call-overload]
    assert penalised.choices[0].text != plain.choices[0].text
    again = client.completions.create(frequency_penalty=2.0, presence_penalty=2.0, **args)  # type: ignore[call-overload]
    assert again.choices[0].text == penalised.choices[0].text  # still deterministic
    assert httpx.get(hs.url.removesuffix("/v1") + "/version").json()["version"]
