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


MC_TASK = """task: slora_mc
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: multiple_choice
doc_to_text: "{{{{question}}}}"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: "{{{{answer}}}}"
metric_list:
  - metric: acc
"""
MC_DOCS = [
    {"question": "The quick brown fox jumps over the", "choices": [" lazy dog", " moon", " city"],
     "answer": 0},
    {"question": "Once upon a time in the", "choices": [" city", " festival of music", " fox"],
     "answer": 0},
    {"question": "Music from the festival", "choices": [" was loud", " is quick", " brown"],
     "answer": 1},
]


def hf_loglikelihood(demo_dir: Path, adapter: str, context: list[int],
                     continuation: list[int]) -> float:
    """log P(continuation | context) from transformers + peft, fp32."""
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(demo_dir / "model", torch_dtype=torch.float32)
    model = PeftModel.from_pretrained(model, demo_dir / "adapters" / adapter).eval()
    ids = context + continuation
    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits[0].double()
    logprobs = torch.log_softmax(logits, dim=-1)
    return sum(float(logprobs[len(context) - 1 + i, t]) for i, t in enumerate(continuation))


def test_lm_eval_local_completions_multiple_choice_equals_transformers_peft(
        hs: HttpStack, demo_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import lm_eval
    from lm_eval.models.openai_completions import LocalCompletionsAPI
    from lm_eval.tasks import TaskManager

    data = tmp_path / "mc.jsonl"
    data.write_text("".join(json.dumps(d) + "\n" for d in MC_DOCS))
    (tmp_path / "slora_mc.yaml").write_text(MC_TASK.format(data=data))
    monkeypatch.setenv("OPENAI_API_KEY", hs.token)
    args = {"model": "qv-r4", "base_url": f"{hs.url}/completions",
            "tokenizer": str(demo_dir / "model"), "tokenizer_backend": "huggingface",
            "num_concurrent": 1, "max_retries": 1}
    out = lm_eval.simple_evaluate(
        model="local-completions", model_args=args, tasks=["slora_mc"],
        task_manager=TaskManager(include_path=str(tmp_path)), log_samples=True, batch_size=1)
    assert out is not None and "acc,none" in out["results"]["slora_mc"]
    lm = LocalCompletionsAPI(**args)  # the same tokenization lm-eval used
    samples = out["samples"]["slora_mc"]
    assert len(samples) == len(MC_DOCS)
    for sample in samples:
        for (context, continuation), resp in zip(sample["arguments"], sample["resps"],
                                                 strict=True):
            ctx_ids, cont_ids = lm._encode_pair(context, continuation)
            want = hf_loglikelihood(demo_dir, "qv-r4", ctx_ids, cont_ids)
            got = float(resp[0][0])
            assert abs(got - want) < 1e-3, (context, continuation, got, want)
