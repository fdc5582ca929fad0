"""Tensor parallelism on the CPU (gloo, 2 processes): a TP=2 engine gives the tokens and
log-probabilities of a TP=1 engine for a mixed batch of demo adapters, through adapter eviction
and sequence preemption; plus the shard arithmetic and the refusals."""

from __future__ import annotations

import multiprocessing
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from slora_core.config import ConfigError, EngineConfig, ModelConfig
from slora_core.engine import LLMEngine
from slora_core.launch import AnyEngine, start_engine
from slora_core.sampling_params import SamplingParams
from slora_core.tp import TPGroup, TPShard
from slora_core.tp.engine import TPEngine
from slora_core.tp.weights import load_model_shard
from slora_core.weights import load_model

ADAPTERS = ("qv-r4", "attn-r8", "all-r16", "ko-r6", "qdown-r20", "pattern-r8")
# Small arena: 10 requests of up to 48 tokens each and six adapters cannot all fit at once.
CONFIG: dict[str, Any] = dict(num_pages=16, block_size=32, max_rank=32, max_num_seqs=8,
              max_num_batched_tokens=96, max_adapters_per_batch=4)


Steps = dict[str, list[tuple[int, float, list[tuple[int, float]]]]]


def _run(engine: AnyEngine, demo: Path) -> Steps:
    for name in ADAPTERS:
        engine.register_adapter(name, demo / "adapters" / name)
    params = SamplingParams(temperature=0.0, max_new_tokens=16, ignore_eos=True, top_logprobs=5)
    for i in range(10):
        prompt = [(7 * i + 13 * j) % 500 + 3 for j in range(20 + 3 * i)]
        adapter = None if i % 5 == 4 else ADAPTERS[i % len(ADAPTERS)]
        engine.add_request(f"r{i}", prompt, params, adapter=adapter)
    got: Steps = {}
    while engine.has_unfinished():
        for out in engine.step():
            for lp in out.logprobs:
                got.setdefault(out.request_id, []).append(
                    (lp.token_id, lp.logprob, list(lp.top_logprobs)))
    return got


def test_tp2_matches_tp1_with_eviction_and_preemption(demo_dir: Path) -> None:
    model_dir = demo_dir / "model"
    ref_engine = LLMEngine(load_model(model_dir, torch.float32, "cpu"),
                           ModelConfig.from_hf_dir(model_dir), None, EngineConfig(**CONFIG))
    ref = _run(ref_engine, demo_dir)
    tp = start_engine(model_dir, EngineConfig(tensor_parallel_size=2, **CONFIG),
                      detokenize=False)
    try:
        got = _run(tp, demo_dir)
        stats = tp.stats
    finally:
        tp.close()
    assert stats.preemptions > 0 and stats.adapter_evictions > 0, stats
    assert sorted(got) == sorted(ref)
    for rid, steps in ref.items():
        assert [t for t, _, _ in got[rid]] == [t for t, _, _ in steps], rid
        for (_, lp, tops), (_, ref_lp, ref_tops) in zip(got[rid], steps, strict=True):
            assert lp == pytest.approx(ref_lp, abs=1e-4)
            assert [i for i, _ in tops] == [i for i, _ in ref_tops]
            assert [v for _, v in tops] == pytest.approx([v for _, v in ref_tops], abs=1e-4)


def test_shards_of_four_ranks_tile_the_checkpoint(demo_dir: Path) -> None:
    """Loading reads only each rank's part; with 4 ranks and 2 KV heads, KV heads replicate."""
    model_dir = demo_dir / "model"
    full = ModelConfig.from_hf_dir(model_dir)
    whole = dict(load_model(model_dir, torch.float32, "cpu").named_parameters())
    shards = [TPShard(full, r, 4) for r in range(4)]
    assert [s.kv_head_start for s in shards] == [0, 0, 1, 1]
    parts = [dict(load_model_shard(model_dir, s, torch.float32, "cpu", TPGroup(s.rank, 4))
                  .named_parameters()) for s in shards]
    qkv, down = "model.layers.1.self_attn.qkv_proj.weight", "model.layers.1.mlp.down_proj.weight"
    d, q = full.head_dim, full.num_attention_heads * full.head_dim
    for s, p in zip(shards, parts, strict=True):
        k0 = q + s.kv_head_start * d
        expect = torch.cat([whole[qkv][s.rank * d:(s.rank + 1) * d], whole[qkv][k0:k0 + d],
                            whole[qkv][k0 + full.num_key_value_heads * d:][:d]])
        assert torch.equal(p[qkv], expect)
    assert torch.equal(torch.cat([p[down] for p in parts], dim=1), whole[down])
    emb = "model.embed_tokens.local.weight"
    assert torch.equal(torch.cat([p[emb] for p in parts]), whole["model.embed_tokens.weight"])


def test_lora_shards_sum_to_the_full_delta() -> None:
    """Column-parallel B rows and row-parallel A columns rebuild the full delta B @ A."""
    full = ModelConfig(hidden_size=32, intermediate_size=48, num_hidden_layers=1,
                       num_attention_heads=4, num_key_value_heads=2, head_dim=8, vocab_size=64)
    gen = torch.Generator().manual_seed(0)
    for module in ("q_proj", "v_proj", "up_proj", "o_proj", "down_proj"):
        fan_in, fan_out = full.module_shape(module)
        a, b = torch.randn(4, fan_in, generator=gen), torch.randn(fan_out, 4, generator=gen)
        pieces = [TPShard(full, r, 2).shard_lora(module, a, b) for r in range(2)]
        if module in ("o_proj", "down_proj"):
            delta = torch.stack([pb @ pa @ _embed_cols(full, r, module)
                                 for r, (pa, pb) in enumerate(pieces)]).sum(0)
        else:
            delta = torch.cat([pb @ pa for pa, pb in pieces])
        assert torch.allclose(delta, b @ a, atol=1e-5), module


def _embed_cols(full: ModelConfig, rank: int, module: str) -> torch.Tensor:
    """[local_in, in] selector placing rank's input columns back in the full input."""
    start, stop = TPShard(full, rank, 2).module_range(module)
    return torch.eye(full.module_shape(module)[0])[start:stop]


def test_refusals(demo_dir: Path) -> None:
    full = ModelConfig.from_hf_dir(demo_dir / "model")
    with pytest.raises(ConfigError, match="does not divide num_attention_heads"):
        TPShard(full, 0, 3)
    with pytest.raises(ConfigError, match="must be positive"):
        EngineConfig(tensor_parallel_size=0)
    with pytest.raises(ConfigError, match="start_engine"):
        LLMEngine(load_model(demo_dir / "model", torch.float32, "cpu"), full, None,
                  EngineConfig(tensor_parallel_size=2))


def test_tp4_replicated_kv_heads_match_tp1(demo_dir: Path) -> None:
    """4 ranks over 2 KV heads: each KV head is held by two ranks. The arena is large enough
    that both engines run the same steps, so every step's full logits are compared too."""
    model_dir = demo_dir / "model"
    config: dict[str, Any] = dict(num_pages=64, block_size=32, max_rank=32)
    params = SamplingParams(temperature=0.0, max_new_tokens=6, ignore_eos=True, top_logprobs=3)
    outs: list[dict[str, list[tuple[int, float]]]] = []
    logits: list[list[torch.Tensor]] = []
    for size in (1, 4):
        engine = start_engine(model_dir, EngineConfig(tensor_parallel_size=size, **config),
                              detokenize=False)
        steps: list[torch.Tensor] = []
        logits.append(steps)
        engine.runner.run = _recording(engine.runner.run, steps)  # type: ignore[method-assign]
        try:
            for i, adapter in enumerate(("all-r16", "ko-r6", None)):
                if adapter:
                    engine.register_adapter(adapter, demo_dir / "adapters" / adapter)
                engine.add_request(f"r{i}", [5 + i, 17, 99, 200 + i, 31], params, adapter=adapter)
            got: dict[str, list[tuple[int, float]]] = {}
            while engine.has_unfinished():
                for out in engine.step():
                    got.setdefault(out.request_id, []).extend(
                        (lp.token_id, lp.logprob) for lp in out.logprobs)
        finally:
            if size > 1:
                engine.close()
        outs.append(got)
    ref, tp = outs
    assert len(logits[0]) == len(logits[1]) > 1
    for ref_step, tp_step in zip(*logits, strict=True):
        torch.testing.assert_close(tp_step, ref_step, rtol=0, atol=1e-4)
    assert sorted(tp) == sorted(ref) == ["r0", "r1", "r2"]
    for rid in ref:
        assert [t for t, _ in tp[rid]] == [t for t, _ in ref[rid]]
        assert [v for _, v in tp[rid]] == pytest.approx([v for _, v in ref[rid]], abs=1e-4)


def _recording(run: Callable[..., torch.Tensor], steps: list[torch.Tensor]
               ) -> Callable[..., torch.Tensor]:
    """`run`, keeping a copy of every step's logits in `steps`."""
    def wrapped(*args: Any) -> torch.Tensor:
        out = run(*args)
        steps.append(out.clone())
        return out
    return wrapped


def test_rank_0_failure_stops_the_other_ranks(demo_dir: Path,
                                              monkeypatch: pytest.MonkeyPatch) -> None:
    """A config rank 0 refuses (here max_model_len above the model's) raises at once and
    leaves no rank process behind."""
    ctx = multiprocessing.get_context("spawn")
    started: list[Any] = []
    make = ctx.Process

    def process(*args: Any, **kwargs: Any) -> Any:
        started.append(make(*args, **kwargs))
        return started[-1]

    monkeypatch.setattr(ctx, "Process", process)
    with pytest.raises(ConfigError, match="max_model_len"):
        start_engine(demo_dir / "model",
                     EngineConfig(tensor_parallel_size=2, max_model_len=10**6))
    assert len(started) == 1 and not started[0].is_alive()


def test_a_failing_rank_reports_before_leaving_and_close_is_bounded(
        demo_dir: Path, capfd: pytest.CaptureFixture[str]) -> None:
    """A rank that fails logs its traceback before it leaves the group (a leave that waits for
    rank 0 must not hide it) and exits; rank 0's close then ends without waiting for it."""
    import time

    tp = start_engine(demo_dir / "model", EngineConfig(tensor_parallel_size=2, **CONFIG),
                      detokenize=False)
    assert isinstance(tp, TPEngine)
    proc = tp.worker_processes[0]
    tp.tp_runner.send([("no-such-op",)])
    proc.join(timeout=30)
    start = time.monotonic()
    tp.close()
    assert time.monotonic() - start < 10
    assert proc.exitcode == 1
    err = capfd.readouterr().err
    assert "tensor-parallel rank 1 failed" in err and "unknown arena op 'no-such-op'" in err


def test_leave_gives_up_on_a_destroy_that_hangs(monkeypatch: pytest.MonkeyPatch) -> None:
    import threading

    import torch.distributed as dist

    release = threading.Event()
    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(dist, "destroy_process_group", lambda: release.wait(10))
    try:
        assert TPGroup(0, 2).leave(timeout_s=0.1) is False
    finally:
        release.set()
