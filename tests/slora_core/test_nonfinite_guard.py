"""The non-finite guard: a request whose logits row holds a NaN or inf never yields a token; it
ends with finish_reason "error" and a message saying so, and the rest of the batch is unchanged."""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path

import pytest
import torch

from slora_core.config import EngineConfig
from slora_core.engine import LLMEngine
from slora_core.outputs import RequestOutput, is_nonfinite_failure
from slora_core.sampler import Sampler
from slora_core.sampling_params import SamplingParams

NEW_TOKENS = 6
PROMPTS = [[5, 17, 42, 99, 7], [300, 12, 8, 77, 150, 151, 152, 3], list(range(20, 60))]


def _sample_both(logits: torch.Tensor, params: list[SamplingParams]):
    n = logits.shape[0]
    args = (logits, params, [None] * n, [()] * n, [0] * n, [2])
    return Sampler(seed=0).sample(*args), Sampler(seed=0).sample_async(*args).result()


def test_sampler_flags_nonfinite_rows_and_leaves_the_others_alone() -> None:
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(5, 50, generator=gen)
    logits[1, 7] = math.nan
    logits[2, 3] = math.inf
    logits[3, 9] = -math.inf  # a single -inf logit is already non-finite output of a model
    params = [SamplingParams(temperature=0, top_logprobs=2)] * 4 + [SamplingParams(
        temperature=0.8, top_p=0.9, seed=None, top_logprobs=2)]
    for got in _sample_both(logits, params):
        assert [t.finite for t in got] == [True, False, False, False, True]
        assert got[0].token_id == int(logits[0].argmax())
        assert got[0].logprob == pytest.approx(float(logits[0].log_softmax(-1).max()))
    # The bad rows change nothing for the good ones (greedy rows compared; the seeded-free
    # sampled row depends on the draw order, which the batch shape fixes).
    clean = logits.clone()
    clean[1:4] = 0.0
    for with_bad, without in zip(_sample_both(logits, params), _sample_both(clean, params),
                                 strict=True):
        assert with_bad[0] == without[0] and with_bad[4] == without[4]


def _poisoned(engine: LLMEngine, source: str) -> None:
    """`source` with B matrices scaled past float32's range: finite weights (validation passes
    them) whose products overflow, so the request's hidden states turn to inf/NaN."""
    good = engine.adapters.get(source).adapter
    weights = {k: dataclasses.replace(w, b=(w.b * 1e37).contiguous())
               for k, w in good.weights.items()}
    # Other content, so another identity (the engine knows adapters by their digest).
    engine.add_adapter("poison", dataclasses.replace(good, weights=weights,
                                                     sha256=f"{good.sha256}-poison"))


def _run(demo_dir: Path, names: list[str], poison: bool, **kw) -> dict[str, list[RequestOutput]]:
    engine = LLMEngine.from_model_dir(demo_dir / "model", EngineConfig(
        max_adapters_per_batch=16, **kw))
    for name in names:
        engine.register_adapter(name, demo_dir / "adapters" / name)
    reqs = [(p, a) for a in [None, *names] for p in PROMPTS]
    if poison:
        _poisoned(engine, names[0])
        reqs.insert(2, (PROMPTS[1], "poison"))
    params = SamplingParams(temperature=0, max_new_tokens=NEW_TOKENS, ignore_eos=True)
    ids = {}
    for i, (prompt, adapter) in enumerate(reqs):
        rid = "poison" if adapter == "poison" else f"{prompt[0]}-{adapter}"
        ids[rid] = i
        engine.add_request(rid, prompt, params, adapter=adapter)
    outs: dict[str, list[RequestOutput]] = {}
    while engine.has_unfinished():
        for out in engine.step():
            outs.setdefault(out.request_id, []).append(out)
    assert engine.pool.num_kv_pages == 0  # the failed request gave its pages back too
    return outs


@pytest.mark.parametrize("async_steps", [False, True])
def test_nonfinite_request_errors_and_the_batch_is_unchanged(demo_dir: Path,
                                                             async_steps: bool) -> None:
    names = ["attn-r8", "all-r16", "rslora-r48"]
    clean = _run(demo_dir, names, poison=False, async_steps=async_steps)
    mixed = _run(demo_dir, names, poison=True, async_steps=async_steps)
    bad = mixed.pop("poison")
    assert [o.token_ids for o in bad] == [[]], "a non-finite row yielded a token"
    last = bad[-1]
    assert last.finished and last.finish_reason == "error" and is_nonfinite_failure(last)
    assert last.error is not None and "non-finite logits" in last.error
    assert last.completion_tokens == 0
    assert set(mixed) == set(clean)
    for rid, outs in clean.items():
        assert [t for o in mixed[rid] for t in o.token_ids] == \
            [t for o in outs for t in o.token_ids], rid
        assert mixed[rid][-1].finish_reason == "length"


def test_logits_that_turn_nonfinite_mid_stream_end_the_request_there(demo_dir: Path) -> None:
    engine = LLMEngine.from_model_dir(demo_dir / "model", EngineConfig())
    run = engine.runner.run
    steps = {"n": 0}

    def nan_on_third_decode(scheduled, patch=None):
        logits = run(scheduled, patch)
        rows = [s.seq.request_id for s in scheduled if s.samples]
        steps["n"] += 1
        if steps["n"] == 3 and "b" in rows:
            logits = logits.clone()  # the runner's output is an inference tensor
            logits[rows.index("b"), 11] = math.nan
        return logits

    engine.runner.run = nan_on_third_decode  # type: ignore[method-assign]
    params = SamplingParams(temperature=0, max_new_tokens=NEW_TOKENS, ignore_eos=True)
    for rid, prompt in zip("abc", PROMPTS, strict=True):
        engine.add_request(rid, prompt, params)
    outs: dict[str, list[RequestOutput]] = {}
    while engine.has_unfinished():
        for out in engine.step():
            outs.setdefault(out.request_id, []).append(out)
    b = outs["b"]
    assert [len(o.token_ids) for o in b] == [1, 1, 0]  # two tokens, then the error
    assert b[-1].finish_reason == "error" and b[-1].completion_tokens == 2
    assert b[-1].error is not None and "output token 2" in b[-1].error
    assert {rid: outs[rid][-1].finish_reason for rid in "ac"} == {"a": "length", "c": "length"}
    assert all(len([t for o in outs[r] for t in o.token_ids]) == NEW_TOKENS for r in "ac")
