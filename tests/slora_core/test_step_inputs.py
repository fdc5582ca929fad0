"""The vectorized step-input builder against a plain per-sequence loop, on every step of an
engine run that mixes prefill chunks, decodes, adapters, the base model and preemptions."""

from __future__ import annotations

import numpy as np
import torch

from devtools.synthetic import random_adapter
from slora_core.config import EngineConfig, ModelConfig
from slora_core.engine import LLMEngine
from slora_core.sampling_params import SamplingParams
from slora_core.step_inputs import StepInputs, build_step_inputs
from slora_core.weights import build_random_model


def _loop_reference(scheduled, pool, block_size: int) -> StepInputs:
    ids, pos, slots, adapters, lens, counts, samples, tables = [], [], [], [], [], [], [], []
    for item in scheduled:
        seq, n = item.seq, item.num_new_tokens
        start = seq.num_computed_tokens
        tokens = seq.token_ids()[start : start + n]
        for j, tok in enumerate(tokens):
            p = start + j
            ids.append(tok)
            pos.append(p)
            slots.append(seq.block_table[p // block_size] * block_size + p % block_size)
            rec = pool.resident(seq.adapter) if seq.adapter is not None else None
            adapters.append(rec.slot if rec is not None else -1)
        lens.append(start + n)
        counts.append(n)
        samples.append(item.samples)
        tables.append(list(seq.block_table))
    seg_starts, seg_lens, seg_slots = [], [], []
    for i, slot in enumerate(adapters):  # maximal runs of one adapter slot, base model left out
        if slot >= 0 and (i == 0 or adapters[i - 1] != slot):
            seg_starts.append(i)
            seg_lens.append(0)
            seg_slots.append(slot)
        if slot >= 0:
            seg_lens[-1] += 1
    width = max(len(t) for t in tables)
    table_arr = np.array([t + [0] * (width - len(t)) for t in tables], dtype=np.int64)
    starts = np.concatenate(([0], np.cumsum(counts))).astype(np.int64)
    i64 = lambda v: np.asarray(v, dtype=np.int64)  # noqa: E731
    return StepInputs(input_ids=i64(ids), positions=i64(pos), slot_mapping=i64(slots),
                      token_slots=i64(adapters), seq_lens=i64(lens), query_starts=starts,
                      block_tables=table_arr, logits_indices=starts[1:][np.array(samples)] - 1,
                      max_query_len=max(counts), seg_starts=i64(seg_starts),
                      seg_lens=i64(seg_lens), seg_slots=i64(seg_slots))


def test_vectorized_inputs_equal_the_loop_on_every_step() -> None:
    cfg = ModelConfig.from_dict({"model_type": "llama", "hidden_size": 32,
                                 "intermediate_size": 64, "num_hidden_layers": 2,
                                 "num_attention_heads": 2, "num_key_value_heads": 1,
                                 "vocab_size": 300, "max_position_embeddings": 512})
    model = build_random_model(cfg, torch.float32, "cpu", seed=0)
    engine = LLMEngine(model, cfg, None, EngineConfig(num_pages=24, block_size=16, max_rank=8, max_num_seqs=12,
                                                      max_num_batched_tokens=48,
                                                      max_adapters_per_batch=3))
    for i in range(5):
        engine.add_adapter(f"a{i}", random_adapter(cfg, 4 + 4 * (i % 2), dtype=torch.float32,
                                                   seed=i))
    rng = np.random.default_rng(5)
    for i in range(30):
        engine.add_request(str(i), rng.integers(3, 300, int(rng.integers(1, 70))).tolist(),
                           SamplingParams(max_new_tokens=int(rng.integers(1, 60)),
                                          ignore_eos=True),
                           adapter=None if i % 4 == 0 else f"a{i % 5}")
    run = engine.runner.run
    steps = []

    def check(scheduled, patch=None):
        got = build_step_inputs(scheduled, engine.arena.block_size)
        want = _loop_reference(scheduled, engine.pool, engine.arena.block_size)
        for field in ("input_ids", "positions", "slot_mapping", "token_slots", "seq_lens",
                      "query_starts", "block_tables", "logits_indices", "seg_starts",
                      "seg_lens", "seg_slots"):
            a, b = getattr(got, field), getattr(want, field)
            assert a.dtype == b.dtype and np.array_equal(a, b), field
        assert got.max_query_len == want.max_query_len
        steps.append(got.max_query_len)
        return run(scheduled, patch)

    engine.runner.run = check  # type: ignore[method-assign]
    while engine.has_unfinished():
        engine.step()
    assert engine.stats.preemptions > 0, "the arena should be small enough to preempt"
    assert 1 in steps and max(steps) > 1  # decode-only steps and prefill steps both met
