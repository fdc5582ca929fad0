"""The Hugging Face side of the tensor-parallel correctness check: a `transformers` Llama holding
exactly the random weights every rank cut its shard from (`RandomWeights`), peft adapters
written from it, and the comparisons of engine runs with it and with each other."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from peft import PeftModel
from transformers import LlamaConfig, LlamaForCausalLM

from bench.numerics_common import (
    Agreement,
    EngineRun,
    hf_logits,
    rel_err,
)
from slora_core.tp.weights import RandomWeights, random_checkpoint_tensor
from slora_core.weights import checkpoint_shapes


@torch.no_grad()
def hf_random_model(weights: RandomWeights, dtype: torch.dtype, device: str) -> Any:
    """A `transformers` LlamaForCausalLM in `dtype` on `device` with `weights`' tensors."""
    c = weights.config
    cfg = LlamaConfig(hidden_size=c.hidden_size, intermediate_size=c.intermediate_size,
                      num_hidden_layers=c.num_hidden_layers,
                      num_attention_heads=c.num_attention_heads,
                      num_key_value_heads=c.num_key_value_heads, vocab_size=c.vocab_size,
                      max_position_embeddings=c.max_position_embeddings,
                      rms_norm_eps=c.rms_norm_eps, tie_word_embeddings=False,
                      rope_parameters={"rope_type": "default", "rope_theta": c.rope_theta},
                      bos_token_id=1, eos_token_id=2)
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            model = LlamaForCausalLM(cfg)
    finally:
        torch.set_default_dtype(previous)
    params = dict(model.named_parameters())
    for index, (name, shape) in enumerate(checkpoint_shapes(c).items()):
        params[name].copy_(random_checkpoint_tensor(weights, index, name, shape, dtype, device))
    return model.eval()


def with_adapters(model: Any, adapters: dict[str, Path]) -> Any:
    """`model` with every adapter directory loaded by peft (switch with set_adapter)."""
    items = list(adapters.items())
    peft_model = PeftModel.from_pretrained(model, str(items[0][1]), adapter_name=items[0][0])
    for name, path in items[1:]:
        peft_model.load_adapter(str(path), adapter_name=name)
    return peft_model.eval()


def against_hf(run: EngineRun, hf: Any, requests: list[tuple[str, list[int], str | None]]
               ) -> dict[str, Any]:
    """Teacher-forced on the engine's own tokens: how often the engine's greedy token is HF's
    argmax, and the largest relative error of a logits row."""
    agree = total = 0
    worst = 0.0
    for rid, prompt, adapter in requests:
        toks = run.tokens[rid]
        if not toks:
            continue
        ref = hf_logits(hf, adapter, (prompt + toks)[:-1], len(toks))
        ours = torch.stack(run.logits[rid][: len(toks)]).to(ref.device)
        agree += int((torch.tensor(toks, device=ref.device) == ref.argmax(-1)).sum())
        total += len(toks)
        worst = max(worst, rel_err(ours, ref))
    return {"greedy_agreement": agree / max(total, 1), "positions": total,
            "max_logits_rel_err": worst}


def tp_vs_tp1(tp: EngineRun, tp1: EngineRun) -> dict[str, Any]:
    """Tokens of two engines on the same requests; logits compared on the common prefix."""
    equal = 0
    first_diff: dict[str, int] = {}
    same = total = 0
    worst = 0.0
    for rid, ref in tp1.tokens.items():
        got = tp.tokens[rid]
        n = next((i for i, (a, b) in enumerate(zip(got, ref, strict=False)) if a != b),
                 min(len(got), len(ref)))
        equal += got == ref
        if got != ref:
            first_diff[rid] = n
        same += n
        total += len(ref)
        if n:
            a = torch.stack(tp.logits[rid][:n])
            worst = max(worst, rel_err(a, torch.stack(tp1.logits[rid][:n]).to(a.device)))
    return {"requests": len(tp1.tokens), "requests_with_equal_tokens": equal,
            "positions_before_first_difference": same, "positions": total,
            "first_difference_at": first_diff, "max_logits_rel_err_on_common_prefix": worst}


@torch.no_grad()
def against_hf_fp32(runs: dict[str, EngineRun], hf: Any,
                    requests: list[tuple[str, list[int], str | None]]) -> dict[str, Any]:
    """The GPU-numerics yardstick for each run: teacher forced on the run's own tokens, its
    greedy agreement with HF float32 next to HF same-dtype's agreement with HF float32 on the
    same positions, with each disagreement's margin (numerics_common.agreement_verdict). `hf`
    (peft adapters included) is in the runs' 16-bit dtype and is turned to float32 in place
    here: the same weight values, float32 arithmetic (peft keeps adapters in float32)."""
    same: dict[str, dict[str, torch.Tensor]] = {
        label: {rid: hf_logits(hf, a, (p + run.tokens[rid])[:-1], len(run.tokens[rid])).cpu()
                for rid, p, a in requests if run.tokens[rid]}
        for label, run in runs.items()}
    hf.float()
    out: dict[str, Any] = {}
    for label, run in runs.items():
        agreement = Agreement()
        for rid, p, a in requests:
            if toks := run.tokens[rid]:
                ref32 = hf_logits(hf, a, (p + toks)[:-1], len(toks)).cpu()
                agreement.add(rid, toks, same[label][rid], ref32)
        out[label] = agreement.summary()
    return out
