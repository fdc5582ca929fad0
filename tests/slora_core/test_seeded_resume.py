"""A seeded request's random draws are a function of (seed, output position), so a stream
resumed after n tokens (the prompt followed by them, seed `advance_seed(seed, n)`) continues
exactly as the uninterrupted one (docs/failover.md): the sampler alone, and the engine end to
end on the CPU, with other requests in the batch."""

from __future__ import annotations

from pathlib import Path

import torch

from slora_core.config import EngineConfig
from slora_core.engine import LLMEngine
from slora_core.sampler import Sampler, advance_seed, make_generator, position_seed
from slora_core.sampling_params import SamplingParams


def test_a_seeded_draw_depends_on_seed_and_position_only() -> None:
    logits = torch.randn(1, 50, generator=torch.Generator().manual_seed(0))
    seed, n = 1234, 5

    def draw(s: int, position: int, fresh: bool = True) -> int:
        p = SamplingParams(temperature=1.0, seed=s)
        gen = make_generator(p, "cpu")
        assert gen is not None
        if not fresh:
            gen.manual_seed(999)  # whatever state the generator had before
        return Sampler().sample(logits, [p], [gen], [()], [position], [])[0].token_id

    draws = [draw(seed, n + p) for p in range(40)]
    assert [draw(advance_seed(seed, n), p, fresh=False) for p in range(40)] == draws
    assert len(set(draws)) > 5  # positions do draw differently
    assert position_seed(seed, 0) != position_seed(seed + 1, 0)
    assert 0 <= position_seed(2**64 - 1, 10**6) < 2**64


def run(engine: LLMEngine, requests: dict[str, tuple[list[int], SamplingParams]],
        ) -> dict[str, list[int]]:
    for rid, (prompt, params) in requests.items():
        engine.add_request(rid, prompt, params)
    out: dict[str, list[int]] = {rid: [] for rid in requests}
    while engine.has_unfinished():
        for o in engine.step():
            out[o.request_id].extend(o.token_ids)
    return out


def test_a_resumed_seeded_stream_continues_as_the_uninterrupted_one(demo_dir: Path) -> None:
    engine = LLMEngine.from_model_dir(demo_dir / "model", EngineConfig())
    prompt = [5, 17, 42, 8, 99, 3]
    seeded = SamplingParams(temperature=1.0, top_p=0.95, seed=42, max_new_tokens=16,
                            ignore_eos=True)
    noise = SamplingParams(temperature=0.8, max_new_tokens=10, ignore_eos=True)
    whole = run(engine, {"whole": (prompt, seeded), "noise": ([7, 7, 7], noise)})["whole"]
    assert len(whole) == 16
    for n in (1, 6, 15):
        rest = SamplingParams(temperature=1.0, top_p=0.95, seed=advance_seed(42, n),
                              max_new_tokens=16 - n, ignore_eos=True)
        # Different batch company than the first run: the draws must not care.
        got = run(engine, {"other": ([1, 2, 3, 4], noise),
                           "rest": (prompt + whole[:n], rest)})["rest"]
        assert got == whole[n:], n
