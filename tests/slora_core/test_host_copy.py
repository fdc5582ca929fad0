"""Host values reach the device without blocking the host (slora_core/host_copy.py): sampling a
launched step's logits and dropping the rows of requests that finished meanwhile make no
synchronizing CUDA call (PyTorch's sync debug mode raises on one), so the host can prepare the
next step while the GPU runs this one. On the CPU the values are the same as torch.tensor's."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from slora_core.config import EngineConfig
from slora_core.engine import LLMEngine
from slora_core.host_copy import host_values, row_index
from slora_core.sampler import Sampler
from slora_core.sampling_params import SamplingParams
from slora_core.step_loop import StepLoop

CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def test_values_and_rows_match_torch_tensor_on_the_cpu() -> None:
    cpu = torch.device("cpu")
    got = host_values([0.5, 1.0, 2.0], torch.float16, cpu)
    assert got.dtype == torch.float16 and torch.equal(got, torch.tensor([0.5, 1.0, 2.0],
                                                                        dtype=torch.float16))
    assert torch.equal(row_index([3, 0, 2], cpu), torch.tensor([3, 0, 2]))
    assert torch.equal(host_values([True, False], torch.bool, cpu), torch.tensor([True, False]))


def _mixed_params() -> list[SamplingParams]:
    """Every per-row parameter the sampler copies to the device, beside greedy rows."""
    return [SamplingParams(temperature=0.8, top_k=20, top_p=0.9, min_p=0.05,
                           repetition_penalty=1.2, frequency_penalty=0.5, presence_penalty=0.3,
                           logit_bias=((5, 2.0), (7, -1.0)), min_new_tokens=3, stop_token_ids=(9,)),
            SamplingParams(temperature=0.0),
            SamplingParams(temperature=1.3, top_k=5),
            SamplingParams(temperature=0.0, repetition_penalty=1.1)]


@CUDA
def test_sampling_a_launched_step_makes_no_synchronizing_call() -> None:
    dev = torch.device("cuda")
    logits = torch.randn(4, 64, device=dev)
    params = _mixed_params()
    history = [[1, 2, 3, 5], [4, 4], [6], [7, 8, 9]]
    sampler = Sampler(seed=0)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        with pytest.raises(RuntimeError):  # the guard catches the copy the sampler made before
            torch.tensor([1.0, 2.0], device=dev)
        pending = sampler.sample_async(logits, params, [None] * 4, history, [1, 2, 3, 4],
                                       eos_token_ids=[2])
    finally:
        torch.cuda.set_sync_debug_mode("default")
    tokens = pending.result()
    assert len(tokens) == 4 and all(0 <= t.token_id < 64 and t.finite for t in tokens)
    # Greedy rows take the argmax of their penalised logits, as the synchronous sample does.
    again = Sampler(seed=0).sample(logits, params, [None] * 4, history, [1, 2, 3, 4],
                                   eos_token_ids=[2])
    assert [tokens[i].token_id for i in (1, 3)] == [again[i].token_id for i in (1, 3)]


@CUDA
def test_dropping_finished_rows_makes_no_synchronizing_call() -> None:
    dev = torch.device("cuda")
    logits = torch.randn(4, 16, device=dev)
    seqs = [SimpleNamespace(name=i) for i in range(4)]
    live = {0, 2, 3}
    loop = SimpleNamespace(requests=SimpleNamespace(is_live=lambda s: s.name in live))
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        kept, sampling = StepLoop._drop_finished(loop, logits, seqs)  # type: ignore[arg-type]
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert kept is not None and [s.name for s in sampling] == [0, 2, 3]
    assert torch.equal(kept, logits[[0, 2, 3]])


@CUDA
def test_asynchronous_steps_make_no_synchronizing_call(demo_dir) -> None:
    """A whole serving stretch after warm-up: requests of every sampling kind, some finishing
    while the next step is already launched, one joining midway. Every step() (eager steps
    too: no graphs) schedules, launches and reads without a synchronizing call; reading a
    step's tokens waits on a CUDA event, which sync-debug mode does not count."""
    engine = LLMEngine.from_model_dir(demo_dir / "model", EngineConfig(
        device="cuda", max_num_seqs=8, max_num_batched_tokens=128, cuda_graphs=False,
        async_steps=True))
    engine.warmup()
    prompt = [5, 6, 7, 8, 9, 10]
    params = [*_mixed_params(), SamplingParams(temperature=0.0, max_new_tokens=3)]
    for p in params:  # the sampler's paths once outside the guard (kernels, allocations)
        engine.add_request(f"warm-{id(p)}", prompt, p)
    while engine.has_unfinished():
        engine.step()
    torch.cuda.synchronize()
    for i, p in enumerate(params):
        engine.add_request(str(i), prompt, p)
    outputs = []
    torch.cuda.set_sync_debug_mode("error")
    try:
        for n in range(200):
            if not engine.has_unfinished():
                break
            if n == 3:
                engine.add_request("late", prompt, SamplingParams(temperature=0.7,
                                                                  max_new_tokens=4))
            outputs += engine.step()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    finished = {o.request_id for o in outputs if o.finished}
    assert finished == {*map(str, range(len(params))), "late"}
