"""Prompt logprobs through the engine (chunked prefill, an adapter, beside plain requests)
against transformers + peft's full forward pass on the same adapter, fp32."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from peft import PeftModel
from transformers import AutoModelForCausalLM

from slora_core.config import EngineConfig
from slora_core.engine import LLMEngine
from slora_core.sampling_params import SamplingParams

PROMPT = [5, 17, 42, 8, 99, 23, 7, 64, 31, 12, 77, 3, 50, 28, 91, 14, 66, 2, 45, 19, 88]


@torch.no_grad()
def hf_prompt_logprobs(demo_dir: Path, adapter: str) -> torch.Tensor:
    model = AutoModelForCausalLM.from_pretrained(demo_dir / "model", torch_dtype=torch.float32)
    model = PeftModel.from_pretrained(model, demo_dir / "adapters" / adapter).eval()
    logits = model(torch.tensor([PROMPT])).logits[0].double()
    return torch.log_softmax(logits, dim=-1)


@pytest.mark.slow
def test_prompt_logprobs_equal_transformers_peft_over_chunked_prefill(demo_dir: Path) -> None:
    engine = LLMEngine.from_model_dir(demo_dir / "model", EngineConfig(
        max_num_batched_tokens=8, num_pages=64))  # 21 prompt tokens: three chunks
    engine.register_adapter("qv-r4", demo_dir / "adapters" / "qv-r4")
    engine.add_request("scored", PROMPT, SamplingParams(temperature=0, max_new_tokens=2,
                                                        prompt_logprobs=3), adapter="qv-r4")
    engine.add_request("plain", PROMPT[:9], SamplingParams(temperature=0, max_new_tokens=4))
    scores: dict[str, list] = {}
    while engine.has_unfinished():
        engine.step()
        for rid, (start, got) in engine.take_prompt_logprobs().items():
            assert start == 1 + len(scores.get(rid, []))  # in order, each position once
            scores.setdefault(rid, []).extend(got)
    assert set(scores) == {"scored"}
    ref = hf_prompt_logprobs(demo_dir, "qv-r4")
    got = scores["scored"]
    assert [p.token_id for p in got] == PROMPT[1:]
    for i, p in enumerate(got):  # position i predicts prompt token i + 1
        assert abs(p.logprob - float(ref[i, PROMPT[i + 1]])) < 1e-3, i
        assert [t for t, _ in p.top_logprobs] == ref[i].topk(3).indices.tolist()
