"""The tools people point at vLLM, installed for real and run against a CPU stack unchanged:
LangChain's ChatOpenAI with named messages, LiteLLM's `hosted_vllm/` provider, guidellm's
streaming benchmark, and lm-eval's `local-completions` loglikelihoods against transformers +
peft on the same adapter. Slow: each loads a large package or runs a benchmark."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from slora.v1 import inference_pb2 as pb
from tests.services.dataplane.dp_support import generate
from tests.services.dataplane.http_support import HttpStack, http_stack

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]
CHAT = [("system", "Answer briefly.", "rules"), ("user", "The quick brown fox", "alice")]


@pytest.fixture(scope="module")
def hs(demo_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[HttpStack]:
    with http_stack(demo_dir, tmp_path_factory.mktemp("tools")) as running:
        yield running


def grpc_chat_text(hs: HttpStack, tokens: int) -> str:
    res = generate(hs.grpc, pb.GenerateRequest(
        messages=[pb.ChatMessage(role=r, content=c, name=n) for r, c, n in CHAT],
        adapter=pb.AdapterRef(adapter_id="qv-r4"),
        sampling=pb.SamplingOptions(max_new_tokens=tokens, temperature=0)), hs.token)
    assert res.error is None, res.details
    return res.text


def test_langchain_chat_openai_with_named_messages(hs: HttpStack) -> None:
    from langchain_core.messages import HumanMessage, SystemMessage
    from langchain_openai import ChatOpenAI

    llm = ChatOpenAI(base_url=hs.url, api_key=hs.token, model="qv-r4",  # type: ignore[arg-type]
                     temperature=0, max_tokens=6, max_retries=0)
    reply = llm.invoke([SystemMessage(CHAT[0][1], name=CHAT[0][2]),
                        HumanMessage(CHAT[1][1], name=CHAT[1][2])])
    assert reply.content == grpc_chat_text(hs, 6)
    streamed = "".join(str(c.content) for c in llm.stream([HumanMessage("Hi", name="bob")]))
    assert isinstance(streamed, str)


def test_litellm_hosted_vllm(hs: HttpStack) -> None:
    import litellm

    r = litellm.completion(model="hosted_vllm/qv-r4", api_base=hs.url, api_key=hs.token,
                           messages=[{"role": r, "content": c, "name": n} for r, c, n in CHAT],
                           temperature=0, max_tokens=6)
    assert r.choices[0].message.content == grpc_chat_text(hs, 6)


def test_guidellm_streaming_benchmark_succeeds_and_reports(hs: HttpStack, demo_dir: Path,
                                                           tmp_path: Path) -> None:
    report = tmp_path / "report.json"
    target = hs.url.removesuffix("/v1")
    out = subprocess.run([
        sys.executable, "-m", "guidellm", "run",
        "--backend", f"kind=openai_http,target={target},model=qv-r4,api_key={hs.token}",
        "--profile", "kind=synchronous", "--constraint", "kind=max_requests,count=6",
        "--data", "kind=synthetic_text,prompt_tokens=16,output_tokens=8",
        "--tokenizer", f"kind=huggingface_auto,model={demo_dir / 'model'}",
        "--output", f"kind=json,path={report}", "--disable-console-interactive"],
        capture_output=True, text=True, timeout=400, cwd=tmp_path)
    assert out.returncode == 0, out.stdout[-4000:] + out.stderr[-4000:]
    data = json.loads(report.read_text())
    text = json.dumps(data)
    assert "time_to_first_token" in text and "inter_token_latency" in text
    totals = find_totals(data)
    assert totals["successful"] == 6 and totals["errored"] == 0 and totals["incomplete"] == 0


def find_totals(data: object) -> dict[str, int]:
    """guidellm's request totals ({successful, errored, incomplete, ...}) wherever they sit."""
    if isinstance(data, dict):
        if {"successful", "errored", "incomplete"} <= set(data) and all(
                isinstance(data[k], int) for k in ("successful", "errored", "incomplete")):
            return data  # type: ignore[return-value]
        for value in data.values():
            found = find_totals(value)
            if found:
                return found
    if isinstance(data, list):
        for value in data:
            found = find_totals(value)
            if found:
                return found
    return {}
