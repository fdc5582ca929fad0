"""A worker's engine-core process hosting rank 0 of a tensor-parallel engine (gloo, 2 ranks on
the CPU): an adapter registered and loaded through the core's commands, and the streamed greedy
tokens and logprobs equal a single-process engine's."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from services.worker.core_client import CoreClient, TokenStream
from slora_core.config import EngineConfig
from slora_core.engine import LLMEngine
from slora_core.sampling_params import SamplingParams

PARAMS = SamplingParams(temperature=0.0, max_new_tokens=8, ignore_eos=True)
PROMPTS = (([5, 17, 99, 200], "all-r16"), ([7, 8, 9], None), ([40, 41, 300], "mlp-r32"))


def _reference(demo: Path) -> list[tuple[list[int], list[float]]]:
    engine = LLMEngine.from_model_dir(demo / "model", EngineConfig(num_pages=64),
                                      detokenize=False)
    for name in ("all-r16", "mlp-r32"):
        engine.register_adapter(name, demo / "adapters" / name)
    for i, (ids, adapter) in enumerate(PROMPTS):
        engine.add_request(str(i), ids, PARAMS, adapter=adapter)
    got: dict[str, tuple[list[int], list[float]]] = {}
    while engine.has_unfinished():
        for out in engine.step():
            toks, lps = got.setdefault(out.request_id, ([], []))
            toks += out.token_ids
            lps += [lp.logprob for lp in out.logprobs]
    return [got[str(i)] for i in range(len(PROMPTS))]


async def _drain(stream: TokenStream) -> tuple[list[int], list[float]]:
    toks: list[int] = []
    lps: list[float] = []
    while True:
        await asyncio.wait_for(stream.event.wait(), 60)
        t, lp, _ = stream.take()
        toks += t
        lps += lp
        if stream.finish is not None:
            return toks, lps


def test_engine_core_hosts_rank_0(demo_dir: Path) -> None:
    ref = _reference(demo_dir)

    async def scenario() -> list[tuple[list[int], list[float]]]:
        core = CoreClient(demo_dir / "model", EngineConfig(num_pages=64, tensor_parallel_size=2))
        await core.start()
        try:
            for name in ("all-r16", "mlp-r32"):
                await core.call("register_adapter", name, str(demo_dir / "adapters" / name), "")
                await core.call("load_adapter", name)
            streams = [core.add(ids, PARAMS, adapter)[1] for ids, adapter in PROMPTS]
            return [await _drain(s) for s in streams]
        finally:
            await core.close()

    got = asyncio.run(scenario())
    for (toks, lps), (ref_toks, ref_lps) in zip(got, ref, strict=True):
        assert toks == ref_toks
        assert lps == pytest.approx(ref_lps, abs=1e-4)
