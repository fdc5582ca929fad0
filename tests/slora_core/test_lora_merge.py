"""Sole-adapter merge (EngineConfig.merge_sole_adapter): steps on one adapter run as the base
model with the adapter folded into the weights, against transformers + peft; every other step
runs on the base weights restored bit for bit."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

from slora_core import lora_merge
from slora_core.config import ConfigError, EngineConfig
from slora_core.engine import LLMEngine
from slora_core.lora_merge import MERGE_AFTER_STEPS, sole_slot
from slora_core.sampling_params import SamplingParams
from slora_core.step_inputs import StepInputs
from slora_kernels.lora_meta import lora_segments
from tests.slora_core.test_engine import hf_greedy

NEW_TOKENS = 24
PROMPTS = [[5, 17, 42, 99, 7], [300, 12, 8, 77, 150, 151], [400, 3]]


def _engine(demo_dir: Path, names: list[str], dtype: str = "float32") -> LLMEngine:
    engine = LLMEngine.from_model_dir(demo_dir / "model",
                                      EngineConfig(merge_sole_adapter=True, dtype=dtype))
    for name in names:
        engine.register_adapter(name, demo_dir / "adapters" / name)
    return engine


def _weakened(demo_dir: Path, name: str, divide: float, dest: Path) -> Path:
    """A copy of a demo adapter with lora_alpha divided: the demo's are made strong (their
    deltas are about the weights' size) so that they change greedy outputs; trained adapters'
    deltas are far smaller."""
    shutil.copytree(demo_dir / "adapters" / name, dest)
    cfg = json.loads((dest / "adapter_config.json").read_text())
    cfg["lora_alpha"] = cfg["lora_alpha"] / divide
    (dest / "adapter_config.json").write_text(json.dumps(cfg))
    return dest


def _generate(engine: LLMEngine, reqs: list[tuple[list[int], str | None]]
              ) -> dict[str, list[int]]:
    params = SamplingParams(temperature=0, max_new_tokens=NEW_TOKENS, ignore_eos=True)
    for i, (prompt, name) in enumerate(reqs):
        engine.add_request(str(i), prompt, params, adapter=name)
    tokens: dict[str, list[int]] = {}
    while engine.has_unfinished():
        for out in engine.step():
            tokens.setdefault(out.request_id, []).extend(out.token_ids)
    return tokens


def _weights(engine: LLMEngine) -> list[torch.Tensor]:
    merge = engine.runner.merge
    assert merge is not None
    return [lin.base.weight.detach().clone() for lin in merge.layers]


def test_one_adapter_runs_merged_and_matches_peft_then_restores_exactly(demo_dir, monkeypatch):
    names = sorted(p.name for p in (demo_dir / "adapters").iterdir())
    adapter = names[0]
    # The demo adapter needs exact values kept for ~22% of the elements (over the default
    # budget, see the next test); here every merge is taken, so the restore's exceptions
    # path carries a large share of the weights.
    monkeypatch.setattr(lora_merge, "MAX_EXCEPTION_FRACTION", 1.0)
    engine = _engine(demo_dir, names[:2])
    merge = engine.runner.merge
    assert merge is not None
    loaded = _weights(engine)

    got = _generate(engine, [(p, adapter) for p in PROMPTS])
    # Most steps ran merged: no LoRA launch, the adapter in the weights.
    assert merge.merges == 1 and merge.merged_steps >= NEW_TOKENS - MERGE_AFTER_STEPS
    assert merge.merged is not None and merge.exceptions > 0 and merge.nbytes > 0
    snap = engine.state_snapshot()  # what the worker's metrics count
    assert (snap.adapter_merges, snap.merged_steps) == (1, merge.merged_steps)
    assert any(not torch.equal(w, w0) for w, w0 in zip(_weights(engine), loaded, strict=True))
    model_dir, adir = demo_dir / "model", demo_dir / "adapters" / adapter
    for i, prompt in enumerate(PROMPTS):
        ref, _ = hf_greedy(model_dir, adir, prompt, NEW_TOKENS)
        assert got[str(i)] == ref, f"prompt {i}"
        # The adapter changes the continuation, so a merge that lost it would fail above.
        assert ref != hf_greedy(model_dir, None, prompt, NEW_TOKENS)[0], f"prompt {i}"

    # A base-model step restores the loaded weights bit for bit, then runs unmerged.
    base = _generate(engine, [(PROMPTS[0], None)])
    assert merge.merged is None and merge.restores == 1
    assert all(torch.equal(w, w0) for w, w0 in zip(_weights(engine), loaded, strict=True))
    assert base["0"] == hf_greedy(model_dir, None, PROMPTS[0], NEW_TOKENS)[0]

    # Two adapters in every step: never merged, each matches peft.
    mixed = _generate(engine, [(PROMPTS[0], names[0]), (PROMPTS[1], names[1])])
    assert merge.merges == 1
    assert mixed["0"] == hf_greedy(model_dir, adir, PROMPTS[0], NEW_TOKENS)[0]
    assert mixed["1"] == hf_greedy(model_dir, demo_dir / "adapters" / names[1], PROMPTS[1],
                                   NEW_TOKENS)[0]


def test_a_merge_needing_too_many_exact_values_is_refused_and_serves_unmerged(demo_dir):
    names = sorted(p.name for p in (demo_dir / "adapters").iterdir())
    engine = _engine(demo_dir, names[:1])
    merge = engine.runner.merge
    assert merge is not None
    loaded = _weights(engine)
    got = _generate(engine, [(p, names[0]) for p in PROMPTS])
    assert (merge.merges, merge.refusals, merge.merged_steps) == (0, 1, 0)
    assert all(torch.equal(w, w0) for w, w0 in zip(_weights(engine), loaded, strict=True))
    adir = demo_dir / "adapters" / names[0]
    for i, prompt in enumerate(PROMPTS):
        assert got[str(i)] == hf_greedy(demo_dir / "model", adir, prompt, NEW_TOKENS)[0]


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1",
                    reason="the fused merge runs on the CPU only under the interpreter")
def test_the_fused_merge_refuses_past_the_budget_and_leaves_the_weights(demo_dir):
    """The kernel's exception buffers hold only the budget: a strong adapter overflows them,
    nothing is merged and the weights stay as loaded."""
    names = sorted(p.name for p in (demo_dir / "adapters").iterdir())
    engine = _engine(demo_dir, names[:1], dtype="float16")
    merge = engine.runner.merge
    assert merge is not None
    merge.fused = True
    loaded = _weights(engine)
    got = _generate(engine, [(p, names[0]) for p in PROMPTS])
    assert (merge.merges, merge.refusals, merge.merged_steps) == (0, 1, 0)
    assert all(len(t) == NEW_TOKENS for t in got.values())
    assert all(torch.equal(w.view(torch.int16), w0.view(torch.int16))
               for w, w0 in zip(_weights(engine), loaded, strict=True))


def _weak_engine(demo_dir: Path, tmp_path: Path, dtype: str, device: str = "cpu"
                 ) -> tuple[LLMEngine, lora_merge.SoleAdapterMerge]:
    """An engine of `dtype` with the merge on and one adapter, "weak": the first demo adapter
    at 1/16 of its scale."""
    names = sorted(p.name for p in (demo_dir / "adapters").iterdir())
    engine = LLMEngine.from_model_dir(
        demo_dir / "model", EngineConfig(merge_sole_adapter=True, dtype=dtype, device=device))
    engine.register_adapter("weak", _weakened(demo_dir, names[0], 16, tmp_path / "weak"))
    assert engine.runner.merge is not None
    return engine, engine.runner.merge


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs a CUDA device"))])
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("fused", [False, True])
def test_16_bit_weights_come_back_bit_for_bit_after_merge_cycles(demo_dir, tmp_path, dtype,
                                                                  device, fused):
    """Adapters with deltas ~1/16 of the demo's (nearer trained ones): merged within the
    budget, the weights exact after each of three merge/restore cycles (on CUDA too: the
    restore needs the delta's GEMM to give the same bits twice there), by torch's passes
    over row chunks and by the fused kernel (slora_kernels.weight_merge, the default on CUDA; on
    the CPU under Triton's interpreter, fp16 only: it computes bf16 wrongly)."""
    if fused and device == "cpu" and (dtype == "bfloat16"
                                      or os.environ.get("TRITON_INTERPRET") != "1"):
        pytest.skip("the fused merge runs on the CPU only under the interpreter, in fp16")
    engine, merge = _weak_engine(demo_dir, tmp_path, dtype, device)
    assert merge.fused == (device == "cuda")  # the default
    merge.fused = fused
    loaded = _weights(engine)
    for cycle in range(3):
        _generate(engine, [(PROMPTS[cycle], "weak")])
        assert merge.merges == cycle + 1 and merge.merged is not None
        changed = sum(lin.base.weight.numel() for lin in merge.layers)
        assert 0 < merge.exceptions < lora_merge.MAX_EXCEPTION_FRACTION * changed
        assert any(not torch.equal(w, w0) for w, w0 in zip(_weights(engine), loaded,
                                                           strict=True))
        _generate(engine, [(PROMPTS[cycle], None)])  # a base step restores
        assert merge.merged is None and merge.nbytes == 0
        assert all(torch.equal(w.view(torch.int16), w0.view(torch.int16))
                   for w, w0 in zip(_weights(engine), loaded, strict=True)), f"cycle {cycle}"


def test_index_checks_catch_a_restore_that_is_not_exact(demo_dir, tmp_path, monkeypatch):
    """With SLORA_CHECK_INDICES the restore compares checksums with the loaded weights: exact
    restores pass, one with its kept values dropped raises."""
    monkeypatch.setattr(lora_merge.step_checks, "ENABLED", True)
    engine, merge = _weak_engine(demo_dir, tmp_path, "float16")
    _generate(engine, [(PROMPTS[0], "weak")])
    merge.restore()  # exact: passes
    _generate(engine, [(PROMPTS[1], "weak")])
    assert merge.merged is not None
    for p in merge._patches:
        p.positions, p.values = p.positions[:0], p.values[:0]
    with pytest.raises(RuntimeError, match="bit for bit"):
        merge.restore()


def test_a_merge_that_runs_out_of_memory_is_undone_and_refused(demo_dir, tmp_path,
                                                              monkeypatch):
    """Device memory running out part-way through a merge (the exceptions or a temporary not
    fitting beside the arena) puts back the chunks merged so far and serves unmerged."""
    engine, merge = _weak_engine(demo_dir, tmp_path, "float16")
    loaded = _weights(engine)
    real, calls = merge._merge_chunk, []

    def chunk(*args: object, budget: int) -> lora_merge._Patch | None:
        calls.append(1)
        if len(calls) == 5:
            raise torch.OutOfMemoryError("no room for the exceptions")
        return real(*args, budget=budget)  # type: ignore[arg-type]

    monkeypatch.setattr(merge, "_merge_chunk", chunk)
    got = _generate(engine, [(PROMPTS[0], "weak")])
    assert (merge.merges, merge.refusals, merge.merged_steps) == (0, 1, 0)
    assert len(got["0"]) == NEW_TOKENS and merge.nbytes == 0
    assert all(torch.equal(w.view(torch.int16), w0.view(torch.int16))
               for w, w0 in zip(_weights(engine), loaded, strict=True))


def test_a_merge_whose_kept_values_would_crowd_free_memory_is_refused(demo_dir, tmp_path,
                                                                      monkeypatch):
    """The kept values may take at most MAX_FREE_MEMORY_SHARE of the device memory free at
    the merge: with little free, the same merge that fits the exceptions budget is refused;
    with plenty, it is taken."""
    engine, merge = _weak_engine(demo_dir, tmp_path, "float16")
    loaded = _weights(engine)
    monkeypatch.setattr(lora_merge, "free_device_bytes", lambda device: 600)
    _generate(engine, [(PROMPTS[0], "weak")])
    assert (merge.merges, merge.refusals) == (0, 1)
    assert all(torch.equal(w.view(torch.int16), w0.view(torch.int16))
               for w, w0 in zip(_weights(engine), loaded, strict=True))
    engine, merge = _weak_engine(demo_dir, tmp_path / "again", "float16")
    monkeypatch.setattr(lora_merge, "free_device_bytes", lambda device: 1 << 40)
    _generate(engine, [(PROMPTS[0], "weak")])
    assert (merge.merges, merge.refusals) == (1, 0)


def test_restore_without_the_kept_values_would_not_be_exact(demo_dir, tmp_path):
    """The exceptions are needed: dropping them from a merge's patches leaves some weights
    off by a unit in the last place (so the exact-restore tests above can fail)."""
    engine, merge = _weak_engine(demo_dir, tmp_path, "float16")
    loaded = _weights(engine)
    _generate(engine, [(PROMPTS[0], "weak")])
    assert merge.merged is not None
    for p in merge._patches:
        p.positions = p.positions[:0]
        p.values = p.values[:0]
    merge.restore()
    assert any(not torch.equal(w, w0) for w, w0 in zip(_weights(engine), loaded, strict=True))


def _inputs(token_slots: list[int]) -> StepInputs:
    slots = np.asarray(token_slots, dtype=np.int64)
    n = slots.size
    seg_starts, seg_lens, seg_slots = lora_segments(slots)
    zeros = np.zeros(n, dtype=np.int64)
    return StepInputs(
        input_ids=zeros, positions=zeros, slot_mapping=zeros, token_slots=slots,
        seq_lens=np.ones(n, dtype=np.int64), query_starts=np.arange(n + 1, dtype=np.int64),
        block_tables=np.zeros((n, 1), dtype=np.int64), logits_indices=np.arange(n),
        max_query_len=1, seg_starts=seg_starts, seg_lens=seg_lens, seg_slots=seg_slots)


def test_sole_slot_needs_every_token_on_one_adapter():
    assert sole_slot(_inputs([3, 3, 3])) == 3
    assert sole_slot(_inputs([3, 4, 3])) is None
    assert sole_slot(_inputs([3, -1])) is None
    assert sole_slot(_inputs([-1, -1])) is None


def test_routing_merges_after_a_streak_restores_on_anything_else_and_backs_off(demo_dir):
    names = sorted(p.name for p in (demo_dir / "adapters").iterdir())
    merge = _engine(demo_dir, names[:1]).runner.merge
    assert merge is not None
    one = _inputs([2, 2, 2, 2])
    for _ in range(MERGE_AFTER_STEPS - 1):
        assert merge.route(one) is one  # not yet: LoRA as usual
    stripped = merge.route(one)
    assert (merge.merges, merge.restores) == (1, 0) and merge.merged is not None
    assert stripped.has_lora is False and (stripped.token_slots == -1).all()
    assert stripped.input_ids is one.input_ids
    # A step with base rows restores first; the merge held 1 step < its wait: the wait doubles.
    mixed = _inputs([2, -1])
    assert merge.route(mixed) is mixed
    assert (merge.merges, merge.restores) == (1, 1) and merge.merged is None
    assert merge.after == 2 * MERGE_AFTER_STEPS
    for _ in range(2 * MERGE_AFTER_STEPS):
        merge.route(one)
    assert merge.merges == 2
    # Held long (4x its wait): the wait halves at the next restore.
    for _ in range(8 * MERGE_AFTER_STEPS):
        assert merge.route(one).has_lora is False
    # The slot refilled by another load (its generation bumped) is a different adapter.
    merge.arena.slot_generation[2] += 1
    assert merge.route(one) is one
    assert merge.restores == 2 and merge.merged is None and merge.after == MERGE_AFTER_STEPS


def test_merge_is_refused_with_tensor_parallelism():
    with pytest.raises(ConfigError, match="merge_sole_adapter"):
        EngineConfig(merge_sole_adapter=True, tensor_parallel_size=2)


def test_merge_defaults_to_one_cuda_device_with_16_bit_weights():
    assert EngineConfig(device="cuda", dtype="float16").merges_sole_adapter
    assert EngineConfig(device="cuda:1", dtype="bfloat16").merges_sole_adapter
    assert not EngineConfig(device="cuda", dtype="float32").merges_sole_adapter
    assert not EngineConfig(device="cpu", dtype="float16").merges_sole_adapter
    assert not EngineConfig(device="cuda", dtype="float16",
                            tensor_parallel_size=2).merges_sole_adapter
    assert not EngineConfig(device="cuda", merge_sole_adapter=False).merges_sole_adapter
    assert EngineConfig(device="cpu", merge_sole_adapter=True).merges_sole_adapter
