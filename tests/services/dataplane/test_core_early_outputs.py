"""A step's read tokens leave the engine core before the next step's sampling is launched
(StepLoop.early_outputs, set by EngineCore): asynchronous steps through the real core loop
on the CPU stream the tokens the synchronous engine gives, one message a step."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from services.worker import core_protocol as m
from services.worker.engine_core import EngineCore
from slora_core.config import EngineConfig
from slora_core.engine import LLMEngine
from slora_core.sampling_params import SamplingParams

PROMPTS = {1: [5, 9, 14, 3, 7], 2: [11, 4, 8], 3: [6, 6, 2, 19, 23, 5, 8]}
NEW = {1: 6, 2: 9, 3: 4}  # the ends fall on different steps


def engine_of(demo_dir: Path, async_steps: bool) -> LLMEngine:
    engine = LLMEngine.from_model_dir(demo_dir / "model", EngineConfig(
        num_pages=64, block_size=16, max_rank=16, async_steps=async_steps))
    for rid, prompt in PROMPTS.items():
        engine.add_request(str(rid), prompt, SamplingParams(
            temperature=0, max_new_tokens=NEW[rid], ignore_eos=True))
    return engine


def test_read_tokens_leave_before_the_next_sampling_and_match_the_engine(
        demo_dir: Path) -> None:
    reference = engine_of(demo_dir, async_steps=False)
    expected: dict[int, list[int]] = {rid: [] for rid in PROMPTS}
    while reference.has_unfinished():
        for out in reference.step():
            expected[int(out.request_id)] += out.token_ids
    reference.close()

    engine = engine_of(demo_dir, async_steps=True)
    events: list[tuple[str, Any]] = []

    class Socket:  # the front's end: what the core sends, in order
        def send(self, data: bytes, copy: bool = True) -> None:
            events.append(("send", m.from_core_decoder.decode(data)))

    core = EngineCore(engine, outputs=Socket(), parent_pid=0)  # type: ignore[arg-type]
    sample_async = engine.loop.sampler.sample_async

    def sampling(*args: Any, **kwargs: Any) -> Any:
        events.append(("sample", None))
        return sample_async(*args, **kwargs)

    engine.loop.sampler.sample_async = sampling  # type: ignore[method-assign]
    steps = 0
    while engine.has_unfinished():
        events.append(("step", None))
        core._step()
        steps += 1
    engine.close()

    got: dict[int, list[int]] = {rid: [] for rid in PROMPTS}
    finished: list[int] = []
    for kind, msg in events:
        if kind == "send":
            for rid, tok in zip(msg.rids, msg.token_ids, strict=True):
                got[rid].append(tok)
            finished += [f.rid for f in msg.finished]
    assert got == expected and sorted(finished) == sorted(PROMPTS)
    assert [kind for kind, _ in events].count("send") == steps  # one message a step
    # In each step that read tokens and sampled again, the tokens left first.
    order = " ".join(kind for kind, msg in events if kind != "send" or msg.token_ids)
    steps_run = [s.split() for s in order.split("step") if s.strip()]
    both = [s for s in steps_run if "send" in s and "sample" in s]
    assert len(both) >= max(NEW.values()) - 2, order
    assert all(s.index("send") < s.index("sample") for s in both), order
