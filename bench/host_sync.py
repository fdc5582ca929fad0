"""What a host-blocking copy after a step's launch costs (`bench.serving --scenarios hostsync`).

The sampler's per-row values (temperatures, top-k/top-p, penalties, the greedy rows) and the
rows of requests that finished while a step ran went to the device through pageable copies
that synchronize the stream (`slora_core/host_copy.py`). Called after a step's launch, each
one held the host until that step's forward ended, and the GPU then idled through the next
launch. This runs the in-process engine in a closed loop (each stream's next request added
when its last finishes, as the service bench's in-process path does) with greedy requests
(only the finished rows' copy) and with sampled ones (temperature 0.8, top-k 50, top-p 0.95:
every step's parameters too), each with the old copies (`sync`: `torch.tensor(values,
device=...)`, patched in for the run) and with `host_values` (`pinned`), interleaved, on one
engine.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager, nullcontext
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

import slora_core.sampler as sampler_module
import slora_core.step_loop as step_loop_module
from slora_core.engine import LLMEngine
from slora_core.sampling_params import SamplingParams

if TYPE_CHECKING:
    from bench.serving import Bench

MODES: dict[str, dict[str, Any]] = {
    "greedy": {"temperature": 0.0},
    "sampled": {"temperature": 0.8, "top_k": 50, "top_p": 0.95},
}


def _sync_values(values: Any, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    return torch.tensor(values, dtype=dtype, device=device)  # the copy before host_values


def _sync_rows(rows: Sequence[int], device: torch.device) -> torch.Tensor:
    return torch.tensor(list(rows), dtype=torch.long, device=device)


@contextmanager
def old_copies() -> Iterator[None]:
    """The sampler and step loop with the synchronizing copies they made before host_copy."""
    saved: list[tuple[Any, str, Callable[..., torch.Tensor]]] = [
        (sampler_module, "host_values", sampler_module.host_values),
        (sampler_module, "row_index", sampler_module.row_index),
        (step_loop_module, "row_index", step_loop_module.row_index)]
    sampler_module.host_values = _sync_values  # type: ignore[assignment]
    sampler_module.row_index = _sync_rows  # type: ignore[assignment]
    step_loop_module.row_index = _sync_rows  # type: ignore[assignment]
    try:
        yield
    finally:
        for module, name, fn in saved:
            setattr(module, name, fn)


def closed_loop(engine: LLMEngine, prompts: list[list[int]], streams: int, new_tokens: int,
                sampling: dict[str, Any]) -> dict[str, float]:
    """`streams` requests in flight, the next added as one finishes; output tokens/s, request
    TTFT p50 (from its add) and how long step() held the host on average."""
    pending = list(range(len(prompts)))[::-1]
    added: dict[str, float] = {}
    first: dict[str, float] = {}
    tokens = 0
    held = []
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    free = streams
    while pending or engine.has_unfinished():
        while pending and free:
            i = pending.pop()
            rid = f"{i}-{t0}"
            engine.add_request(rid, prompts[i], SamplingParams(
                max_new_tokens=new_tokens, ignore_eos=True, **sampling))
            added[rid] = time.perf_counter()
            free -= 1
        s = time.perf_counter()
        outs = engine.step()
        now = time.perf_counter()
        held.append(now - s)
        for out in outs:
            if out.token_ids and out.request_id not in first:
                first[out.request_id] = now - added[out.request_id]
            tokens += len(out.token_ids)
            free += out.finished
    wall = time.perf_counter() - t0
    return {"output_tok_per_s": tokens / wall, "wall_s": wall, "output_tokens": tokens,
            "request_ttft_p50_ms": float(np.median(list(first.values()))) * 1e3,
            "step_call_ms_p50": float(np.median(held)) * 1e3}


def scenario_hostsync(b: Bench) -> dict[str, Any]:
    a = b.args
    streams = a.hostsync_streams
    rng = np.random.default_rng(0)
    prompts = [rng.integers(3, b.cfg.vocab_size, int(rng.integers(16, 64))).tolist()
               for _ in range(streams * a.hostsync_requests_per_stream)]
    engine = b.engine(1, (16,))
    closed_loop(engine, prompts[:streams], streams, 8, MODES["sampled"])  # warm both paths
    runs: dict[str, dict[str, list[dict[str, float]]]] = {
        m: {"sync": [], "pinned": []} for m in MODES}
    for rep in range(a.hostsync_repeats):
        for mode, sampling in MODES.items():
            for copies in ("sync", "pinned"):
                with old_copies() if copies == "sync" else nullcontext():
                    r = closed_loop(engine, prompts, streams, a.hostsync_new_tokens, sampling)
                runs[mode][copies].append(r)
                print(f"hostsync {mode} {copies} {rep + 1}: {r['output_tok_per_s']:.0f} tok/s, "
                      f"TTFT p50 {r['request_ttft_p50_ms']:.1f} ms, step() "
                      f"{r['step_call_ms_p50']:.2f} ms", flush=True)
                b.checkpoint("hostsync", {"runs": runs})
    out: dict[str, Any] = {"streams": streams, "new_tokens": a.hostsync_new_tokens,
                           "requests": len(prompts), "runs": runs}
    for mode in MODES:
        ratios = [p["output_tok_per_s"] / s["output_tok_per_s"]
                  for s, p in zip(runs[mode]["sync"], runs[mode]["pinned"], strict=True)]
        out[mode] = {"throughput_ratio_pinned_over_sync": float(np.median(ratios)),
                     "ratio_min": min(ratios), "ratio_max": max(ratios)}
    return out
