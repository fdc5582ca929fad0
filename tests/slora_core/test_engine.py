"""The engine against Hugging Face transformers + peft: one mixed multi-LoRA batch, greedy tokens
request by request, and next-token logits; then the same with a tiny arena (eviction and
preemption), and bad adapters that must not disturb the others."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from peft import PeftModel
from transformers import AutoModelForCausalLM

from slora_core.adapters import AdapterError
from slora_core.config import EngineConfig
from slora_core.engine import LLMEngine, RequestError
from slora_core.sampling_params import SamplingParams

NEW_TOKENS = 8
PROMPTS = [
    [5, 17, 42, 99, 7],
    [300, 12, 8, 77, 150, 151, 152, 3, 9, 11, 64, 65, 66],
    [400],
    list(range(20, 80)),  # crosses a 64-token block while decoding
]


def _requests(adapters: list[str]) -> list[tuple[list[int], str | None]]:
    names: list[str | None] = [None, *adapters, None]
    return [(PROMPTS[i % len(PROMPTS)], name) for i, name in enumerate(names)]


@torch.no_grad()
def hf_greedy(model_dir: Path, adapter_dir: Path | None, prompt: list[int], n: int
              ) -> tuple[list[int], torch.Tensor]:
    """Greedy continuation by full forward passes; also the logits after the prompt."""
    model = AutoModelForCausalLM.from_pretrained(model_dir, torch_dtype=torch.float32)
    if adapter_dir is not None:
        model = PeftModel.from_pretrained(model, adapter_dir)
    model.eval()
    ids = list(prompt)
    first = None
    for _ in range(n):
        logits = model(torch.tensor([ids])).logits[0, -1].float()
        if first is None:
            first = logits
        ids.append(int(logits.argmax()))
    return ids[len(prompt):], first


@pytest.fixture(scope="module")
def adapter_names(demo_dir: Path) -> list[str]:
    return sorted(p.name for p in (demo_dir / "adapters").iterdir())


@pytest.fixture(scope="module")
def hf_reference(demo_dir: Path, adapter_names: list[str]):
    refs = {}
    for prompt, name in _requests(adapter_names):
        adir = demo_dir / "adapters" / name if name else None
        refs[(tuple(prompt), name)] = hf_greedy(demo_dir / "model", adir, prompt, NEW_TOKENS)
    return refs


def make_engine(demo_dir: Path, adapter_names: list[str], **kw) -> LLMEngine:
    engine = LLMEngine.from_model_dir(demo_dir / "model", EngineConfig(**kw))
    for name in adapter_names:
        engine.register_adapter(name, demo_dir / "adapters" / name)
    return engine


def run_all(engine: LLMEngine, reqs, capture_logits: bool = False):
    """Run every request to completion; returns tokens per request and first-step logits."""
    first_logits: dict[str, torch.Tensor] = {}
    if capture_logits:
        run = engine.runner.run

        def spy(scheduled, patch=None):
            logits = run(scheduled, patch)
            sampling = [s.seq for s in scheduled if s.samples]
            for seq, row in zip(sampling, logits, strict=True):
                first_logits.setdefault(seq.request_id, row.clone())
            return logits

        engine.runner.run = spy  # type: ignore[method-assign]
    params = SamplingParams(temperature=0, max_new_tokens=NEW_TOKENS, ignore_eos=True)
    for i, (prompt, name) in enumerate(reqs):
        engine.add_request(str(i), prompt, params, adapter=name)
    tokens: dict[str, list[int]] = {}
    reasons: dict[str, str] = {}
    while engine.has_unfinished():
        for out in engine.step():
            tokens.setdefault(out.request_id, []).extend(out.token_ids)
            if out.finished:
                reasons[out.request_id] = out.finish_reason
    assert set(reasons.values()) == {"length"}
    return tokens, first_logits


def test_mixed_batch_matches_transformers_peft(demo_dir, adapter_names, hf_reference):
    reqs = _requests(adapter_names)
    engine = make_engine(demo_dir, adapter_names, max_adapters_per_batch=16)
    tokens, logits = run_all(engine, reqs, capture_logits=True)
    distinct_outputs = set()
    for i, (prompt, name) in enumerate(reqs):
        ref_tokens, ref_logits = hf_reference[(tuple(prompt), name)]
        assert tokens[str(i)] == ref_tokens, f"request {i} adapter {name}"
        rel = (logits[str(i)] - ref_logits).norm() / ref_logits.norm()
        assert rel < 1e-4, f"request {i} adapter {name}: logits rel err {rel:.2e}"
        distinct_outputs.add((tuple(prompt), tuple(ref_tokens)))
    # The adapters really change the outputs (else this test could not fail on LoRA bugs).
    assert len(distinct_outputs) > len(PROMPTS)


def test_tiny_arena_evicts_and_preempts_with_same_outputs(demo_dir, adapter_names, hf_reference):
    reqs = _requests(adapter_names) * 2
    # Room for a few adapters and KV blocks only: adapters are evicted, sequences preempted.
    engine = make_engine(demo_dir, adapter_names, num_pages=20, block_size=64, max_num_seqs=8,
                         max_num_batched_tokens=48, max_adapters_per_batch=3)
    tokens, _ = run_all(engine, reqs)
    for i, (prompt, name) in enumerate(reqs):
        assert tokens[str(i)] == hf_reference[(tuple(prompt), name)][0], f"request {i} {name}"
    assert engine.stats.adapter_evictions > 0
    assert engine.stats.preemptions > 0
    assert engine.pool.num_kv_pages == 0  # everything given back


def _broken_copies(demo_dir: Path, tmp: Path) -> dict[str, tuple[Path, str]]:
    src = demo_dir / "adapters" / "attn-r8"
    cases: dict[str, tuple[Path, str]] = {}

    def copy(name: str) -> Path:
        dst = tmp / name
        shutil.copytree(src, dst)
        return dst

    d = copy("dora")
    cfg = json.loads((d / "adapter_config.json").read_text())
    cfg["use_dora"] = True
    (d / "adapter_config.json").write_text(json.dumps(cfg))
    cases["dora"] = (d, "dora")
    d = copy("truncated")
    data = (d / "adapter_model.safetensors").read_bytes()
    (d / "adapter_model.safetensors").write_bytes(data[: len(data) // 2])
    cases["truncated"] = (d, "safetensors")
    d = copy("badjson")
    (d / "adapter_config.json").write_text("{not json")
    cases["badjson"] = (d, "adapter_config.json")
    cases["missing"] = (tmp / "nope", "nope")
    return cases


def test_bad_adapters_are_refused_and_the_engine_keeps_serving(demo_dir, adapter_names,
                                                               hf_reference, tmp_path):
    engine = make_engine(demo_dir, adapter_names[:2])
    for name, (path, needle) in _broken_copies(demo_dir, tmp_path).items():
        with pytest.raises(AdapterError) as err:
            engine.register_adapter(name, path)
        assert needle.lower() in str(err.value).lower(), str(err.value)
        assert not engine.adapters.is_registered(name)
    with pytest.raises(KeyError, match="unknown adapter"):
        engine.add_request("x", [1, 2], SamplingParams(), adapter="dora")
    with pytest.raises(RequestError, match="max_model_len"):
        engine.add_request("y", [1, 2], SamplingParams(max_new_tokens=10**6))
    reqs = [(PROMPTS[1], adapter_names[0]), (PROMPTS[0], None)]
    tokens, _ = run_all(engine, reqs)
    for i, (prompt, name) in enumerate(reqs):
        assert tokens[str(i)] == hf_reference[(tuple(prompt), name)][0]


def test_abort_frees_pages(demo_dir, adapter_names):
    engine = make_engine(demo_dir, adapter_names[:1])
    engine.add_request("a", PROMPTS[3], SamplingParams(max_new_tokens=50), adapter=adapter_names[0])
    engine.step()
    assert engine.pool.num_kv_pages > 0
    out = engine.abort_request("a")
    assert out is not None and out.finish_reason == "abort"
    assert engine.pool.num_kv_pages == 0 and not engine.has_unfinished()
    # Arena pages are kept by content digest, not by name (issue 33).
    assert engine.pool.resident(engine.adapters.digest_of(adapter_names[0])).refcount == 0


def test_stats_count_the_last_steps_tokens_and_prompt_chunk_tokens(demo_dir, adapter_names):
    engine = make_engine(demo_dir, adapter_names[:1])
    params = SamplingParams(temperature=0, max_new_tokens=4, ignore_eos=True)
    engine.add_request("a", PROMPTS[3], params, adapter=adapter_names[0])
    engine.step()  # the whole prompt: one chunk
    first = (engine.stats.last_tokens, engine.stats.last_prefill_tokens)
    engine.add_request("b", PROMPTS[1], params)
    engine.step()  # b's prompt beside a's decode token
    second = (engine.stats.last_tokens, engine.stats.last_prefill_tokens)
    engine.step()  # both decoding
    third = (engine.stats.last_tokens, engine.stats.last_prefill_tokens)
    assert first[0] == first[1] > 1
    assert second[0] == second[1] + 1 and second[1] > 1
    assert third == (2, 0)


def test_deadline_drops_a_request_that_never_started(demo_dir, adapter_names):
    engine = make_engine(demo_dir, adapter_names[:1], max_num_seqs=1)
    params = SamplingParams(temperature=0, max_new_tokens=3, ignore_eos=True)
    engine.add_request("first", PROMPTS[0], params)
    engine.add_request("late", PROMPTS[1], params, deadline_s=0.0)
    outs = {o.request_id: o for o in engine.step()}
    assert outs["late"].finished and outs["late"].finish_reason == "abort"
    assert "deadline" in (outs["late"].error or "")
    assert "first" in outs and not outs["first"].finished


def test_preempted_requests_are_not_expired_by_their_deadline(demo_dir, monkeypatch):
    """Requests that started run to the end through preemptions, long past their deadline; a
    request that never started expires (the engine's clock is 10 s per step here)."""
    import types

    from slora_core import intake as intake_module
    from slora_core import scheduler as scheduler_module

    clock = [0.0]
    fake = types.SimpleNamespace(monotonic=lambda: clock[0])
    monkeypatch.setattr(scheduler_module, "time", fake)
    monkeypatch.setattr(intake_module, "time", fake)
    engine = LLMEngine.from_model_dir(demo_dir / "model", EngineConfig(
        num_pages=6, block_size=16, max_rank=8, max_num_seqs=4))
    params = SamplingParams(temperature=0, max_new_tokens=40, ignore_eos=True)
    for i in range(4):  # three fill the arena; the fourth cannot start before its deadline
        engine.add_request(str(i), list(range(20 + i, 50 + i)), params, deadline_s=5.0)
    got: dict[str, list] = {}
    while engine.has_unfinished():
        for out in engine.step():
            got.setdefault(out.request_id, []).append(out)
        clock[0] += 10.0
    assert engine.stats.preemptions > 0
    for rid in ("0", "1", "2"):
        assert sum(len(o.token_ids) for o in got[rid]) == 40, rid
        assert got[rid][-1].finish_reason == "length", rid
    assert got["3"][-1].finish_reason == "abort" and not got["3"][-1].token_ids
    assert got["3"][-1].error == "deadline exceeded before the request was scheduled"


def test_sliding_window_models_need_max_model_len_within_the_window():
    from slora_core.config import ConfigError, ModelConfig

    base = {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 1,
            "num_attention_heads": 2, "num_key_value_heads": 1, "vocab_size": 50}
    mistral = ModelConfig.from_dict({**base, "model_type": "mistral", "sliding_window": 256})
    assert mistral.sliding_window == 256
    with pytest.raises(ConfigError, match="max_model_len <= 256"):
        EngineConfig(max_model_len=2048).check_model(mistral)
    EngineConfig(max_model_len=256).check_model(mistral)
    qwen = ModelConfig.from_dict({**base, "model_type": "qwen2", "sliding_window": 256,
                                  "use_sliding_window": False})
    assert qwen.sliding_window is None  # Qwen2 declares a window it does not use


def test_lora_launches_only_for_modules_some_resident_adapter_targets(demo_dir, adapter_names,
                                                                       hf_reference, monkeypatch):
    """A q,v-only adapter: the q/k/v launch carries q and v alone, o/MLP launch nothing; the
    tokens still equal HF+peft's; once the adapter is evicted no module is active."""
    from slora_core import lora as lora_module
    from slora_core.config import MODULE_INDEX

    launched: list[tuple[int, ...]] = []
    real = lora_module.ops.add_lora

    def spy(*args, **kwargs):
        launched.append(tuple(args[7]))
        return real(*args, **kwargs)

    monkeypatch.setattr(lora_module.ops, "add_lora", spy)
    engine = make_engine(demo_dir, ["qv-r4"], cuda_graphs=False)
    reqs = [r for r in _requests(adapter_names) if r[1] == "qv-r4"]
    tokens, _ = run_all(engine, reqs)
    for i, (prompt, name) in enumerate(reqs):
        assert tokens[str(i)] == hf_reference[(tuple(prompt), name)][0]
    qv = (MODULE_INDEX["q_proj"], MODULE_INDEX["v_proj"])
    assert engine.arena.active_lora_modules == frozenset(qv)
    assert launched and set(launched) == {qv}
    slot = engine.pool.resident(engine.adapters.digest_of("qv-r4")).slot
    engine.arena.clear_slot(slot)
    assert engine.arena.active_lora_modules == frozenset()


def test_padded_mixed_step_gives_the_unpadded_logits(demo_dir, adapter_names):
    """The inputs CUDA graphs of mixed steps replay (tokens padded to a bucket, sequences to
    max_num_seqs, LoRA tiles padded) give the same logits as the unpadded step, every step of
    a batch mixing prefill chunks, decodes, adapters and the base model."""
    from slora_core.cuda_graphs import MixedGraphs
    from slora_core.step_inputs import build_step_inputs

    engine = make_engine(demo_dir, adapter_names[:4], max_num_batched_tokens=48, max_num_seqs=8)
    runner = engine.runner
    mixed = MixedGraphs(runner, 8, 48, engine.config.max_model_len)
    run = runner.run
    checked = []

    def both(scheduled, patch=None):
        logits = run(scheduled, patch)
        inputs = build_step_inputs(scheduled, runner.arena.block_size)
        if inputs.max_query_len > 1:
            with torch.inference_mode():
                padded = mixed.run_padded_eager(inputs)
            torch.testing.assert_close(padded, logits, rtol=1e-5, atol=1e-5)
            checked.append(int(inputs.input_ids.size))
        return logits

    runner.run = both  # type: ignore[method-assign]
    reqs = _requests(adapter_names[:4])
    tokens, _ = run_all(engine, reqs)
    assert len(checked) >= 3 and any(n < 48 for n in checked)
    assert len(tokens) == len(reqs)


def test_padded_decode_step_gives_the_unpadded_logits(demo_dir, adapter_names):
    """The inputs decode CUDA graphs replay (rows padded to a bucket, the spare table slot on
    base and padding rows, a padded LoRA tile list) give the unpadded logits on every decode
    step of a batch of adapters and the base model."""
    from slora_core.cuda_graphs import DecodeGraphs
    from slora_core.step_inputs import build_step_inputs

    engine = make_engine(demo_dir, adapter_names[:5], max_num_seqs=12)
    runner = engine.runner
    graphs = DecodeGraphs(runner, 12, engine.config.max_model_len)
    run = runner.run
    checked = []

    def both(scheduled, patch=None):
        logits = run(scheduled, patch)
        inputs = build_step_inputs(scheduled, runner.arena.block_size)
        if graphs.can_run(inputs):
            with torch.inference_mode():
                padded = graphs.run_padded_eager(inputs)
            torch.testing.assert_close(padded, logits, rtol=1e-5, atol=1e-5)
            checked.append(inputs.num_seqs)
        return logits

    runner.run = both  # type: ignore[method-assign]
    reqs = _requests(adapter_names[:5])
    tokens, _ = run_all(engine, reqs)
    assert len(checked) >= 3 and any(n not in graphs.buckets for n in checked)
    assert len(tokens) == len(reqs)


def _varied_run(demo_dir, adapter_names, **config):
    """Every request's (tokens, text, finish reason, logprobs) on a workload that exercises
    greedy and seeded sampling, stop ids and strings, EOS, min_new_tokens, the repetition
    penalty, top logprobs, a small arena (preemption) and an abort half-way."""
    engine = make_engine(demo_dir, adapter_names[:6], num_pages=24, max_num_seqs=10,
                         max_num_batched_tokens=40, **config)
    run = engine.runner.run
    patched = []

    def counting(scheduled, patch=None):
        patched.append(0 if patch is None else int(patch.dst.size))
        return run(scheduled, patch)

    engine.runner.run = counting  # type: ignore[method-assign]
    rng = torch.Generator().manual_seed(7)
    kinds = [
        SamplingParams(temperature=0, max_new_tokens=20, ignore_eos=True, top_logprobs=2),
        SamplingParams(temperature=0.9, top_p=0.9, seed=11, max_new_tokens=16),
        SamplingParams(temperature=0.7, top_k=5, seed=3, max_new_tokens=12, min_new_tokens=6),
        SamplingParams(temperature=0, max_new_tokens=30, repetition_penalty=1.3),
        SamplingParams(temperature=0, max_new_tokens=25, stop_token_ids=(100, 200, 300)),
        SamplingParams(temperature=1.0, seed=5, max_new_tokens=18, stop=("e",)),
    ]
    names = [None, *adapter_names[:6]]
    for i in range(21):
        n = int(torch.randint(3, 60, (1,), generator=rng))
        prompt = torch.randint(3, 500, (n,), generator=rng).tolist()
        engine.add_request(str(i), prompt, kinds[i % len(kinds)], adapter=names[i % len(names)])
    got: dict[str, list] = {}
    steps = 0
    while engine.has_unfinished():
        steps += 1
        if steps == 9:
            out = engine.abort_request("4")
            if out is not None:
                got.setdefault("4", []).append((out.token_ids, out.text, out.finish_reason, []))
        for out in engine.step():
            got.setdefault(out.request_id, []).append(
                (out.token_ids, out.text, out.finish_reason,
                 [(lp.token_id, round(lp.logprob, 4)) for lp in out.logprobs]))
    engine.stats.patched_tokens = sum(patched)  # type: ignore[attr-defined]
    merged = {}
    for rid, parts in got.items():
        merged[rid] = ([t for p in parts for t in p[0]], "".join(p[1] for p in parts),
                       [p[2] for p in parts if p[2]], [lp for p in parts for lp in p[3]])
    return merged, engine.stats


def test_async_steps_give_the_same_outputs_as_synchronous_steps(demo_dir, adapter_names):
    """Launching step N+1 before the host reads step N's ids (placeholders patched on the
    device) changes nothing a client sees: same tokens, text and finish reasons for every
    request, logprobs equal to float32 noise (a finished request's extra row changes the batch
    shape of one step), with preemptions and an abort in the run."""
    sync_out, sync_stats = _varied_run(demo_dir, adapter_names)
    async_out, async_stats = _varied_run(demo_dir, adapter_names, async_steps=True)
    assert sync_stats.preemptions > 0
    assert sync_stats.patched_tokens == 0 and async_stats.patched_tokens > 100
    assert set(sync_out) == set(async_out) and len(sync_out) == 21
    for rid in sync_out:
        assert async_out[rid][:3] == sync_out[rid][:3], rid
        a_lp, s_lp = async_out[rid][3], sync_out[rid][3]
        assert [t for t, _ in a_lp] == [t for t, _ in s_lp], rid
        assert all(abs(a - b) < 1e-3 for (_, a), (_, b) in zip(a_lp, s_lp, strict=True)), rid
