"""Steps with prompt tokens run LoRA in 16-row tiles up to SHORT_TILES_MAX_TOKENS tokens and in
64-row tiles past it (slora_kernels.lora_meta.tile_rows), in mixed graphs and eager steps: the
padded step a graph replays gives the logits of the unpadded eager step, on several adapters
(one-row decode segments beside prompt chunks), in both tile heights."""

from __future__ import annotations

import pytest
import torch

from slora_core import cuda_graphs, ops
from slora_core.config import EngineConfig
from slora_core.engine import LLMEngine
from slora_core.sampling_params import SamplingParams
from slora_core.step_inputs import build_step_inputs, step_arrays
from slora_kernels import lora_meta
from slora_kernels.lora_meta import DECODE_BLOCK_M, PREFILL_BLOCK_M, tile_rows


def test_tile_rows_by_step_tokens() -> None:
    rows = cuda_graphs.MixedGraphs._tile_rows
    limit = lora_meta.SHORT_TILES_MAX_TOKENS
    assert rows(16) == rows(limit) == DECODE_BLOCK_M
    assert rows(limit + 1) == PREFILL_BLOCK_M
    # Eager steps: by their tokens, and 16-row tiles whenever every segment fits one.
    assert tile_rows(300, 320) == tile_rows(16, 4096) == DECODE_BLOCK_M
    assert tile_rows(300, limit + 1) == tile_rows(300) == PREFILL_BLOCK_M


def test_padded_mixed_steps_in_both_tile_heights_give_the_unpadded_logits(
        demo_dir, monkeypatch: pytest.MonkeyPatch) -> None:
    # Buckets of 16 and 32 tokens run 16-row tiles, of 64 the 64-row ones; prompt chunks of
    # more than 16 tokens make the two tile lists differ in every bucket past 16.
    monkeypatch.setattr(lora_meta, "SHORT_TILES_MAX_TOKENS", 32)
    # The CPU engine's LoRA is the torch reference, which reads segments, not the tile list:
    # the LoRA kernels (Triton's interpreter) read the tiles the graphs lay out.
    real_use_triton = ops._use_triton
    monkeypatch.setattr(ops, "_use_triton", lambda t: True)
    names = sorted(p.name for p in (demo_dir / "adapters").iterdir())[:3]
    engine = LLMEngine.from_model_dir(demo_dir / "model", EngineConfig(
        max_num_batched_tokens=64, max_num_seqs=8, cuda_graphs=False, merge_sole_adapter=False))
    for name in names:
        engine.register_adapter(name, demo_dir / "adapters" / name)
        engine.load_adapter(name)
    runner = engine.runner
    mixed = cuda_graphs.MixedGraphs(runner, 8, 64, engine.config.max_model_len)
    run = runner.run
    checked: list[tuple[int, int]] = []
    eager_rows: set[int] = set()

    def both(scheduled, patch=None):  # type: ignore[no-untyped-def]
        with monkeypatch.context() as m:  # the unpadded step as the CPU runs it: no tiles
            m.setattr(ops, "_use_triton", real_use_triton)
            logits = run(scheduled, patch)
        inputs = build_step_inputs(scheduled, runner.arena.block_size)
        if inputs.max_query_len > 1 and inputs.has_lora and mixed.can_run(inputs):
            longest, tokens = int(inputs.seg_lens.max()), int(inputs.num_tokens)
            rows = DECODE_BLOCK_M if tokens <= 32 or longest <= 16 else PREFILL_BLOCK_M
            assert step_arrays(inputs)[1].block_m == rows
            bucket = mixed.prepare(inputs)[0]
            kind = (bucket, mixed._tile_rows(bucket))
            # One step of each kind (graph bucket and tile height, eager tile height) is
            # checked: each costs two forwards on the interpreter.
            if kind in checked and rows in eager_rows:
                return logits
            with torch.inference_mode():
                padded = mixed.run_padded_eager(inputs)
                eager = run(scheduled, patch)  # the eager step's own tile list, on kernels
            torch.testing.assert_close(padded, logits, rtol=1e-4, atol=1e-4)
            torch.testing.assert_close(eager, logits, rtol=1e-4, atol=1e-4)
            eager_rows.add(rows)
            checked.append(kind)
        return logits

    runner.run = both  # type: ignore[method-assign]
    params = SamplingParams(temperature=0, max_new_tokens=8, ignore_eos=True)
    # Staggered prompts on three adapters and the base model: each arrives as prompt chunks
    # beside the others' one-row decode segments.
    prompts = [(list(range(3, 12)), names[0]), (list(range(20, 60)), names[1]),
               (list(range(70, 75)), None), (list(range(80, 105)), names[2]),
               (list(range(110, 160)), names[2]), (list(range(170, 177)), names[0])]
    for i, (prompt, adapter) in enumerate(prompts):
        engine.add_request(str(i), prompt, params, adapter=adapter)
        engine.step()
        engine.step()
    while engine.has_unfinished():
        engine.step()
    assert {(32, DECODE_BLOCK_M), (64, PREFILL_BLOCK_M)} <= set(checked), checked
    assert eager_rows == {DECODE_BLOCK_M, PREFILL_BLOCK_M}
