"""Replaying a workload against an in-process engine: warm-up, timing, latency figures."""

from __future__ import annotations

import faulthandler
import gc
import hashlib
import sys
import time
from typing import Any

import numpy as np
import torch
from tqdm import tqdm

from bench.workload import BenchRequest
from slora_core.launch import AnyEngine
from slora_core.sampling_params import SamplingParams
from slora_kernels.jit_stats import compiled_kernel_variants

# A replay that makes no progress (no token out) for this long prints every thread's stack, and
# again each period after: where a stalled run waits (a Triton compile, a CUDA sync, a lock).
# When steps still return, the engine's state is printed too (a livelock, not a hang).
STALL_DUMP_S = 20.0


def warm(engine: AnyEngine, vocab: int, num_adapters: int) -> None:
    """Compile kernels and capture every decode graph before anything is timed: mixed batches
    (prefills of several lengths, short and long segments, decode, adapters and base), then
    reset stats."""
    engine.warmup()
    rng = np.random.default_rng(99)
    lengths = (7, 64, 300, 1000, *(5 + i for i in range(20)))
    for i, n in enumerate(lengths):
        adapter = f"a{i % num_adapters}" if num_adapters and i % 2 == 0 else None
        engine.add_request(f"warm{i}", rng.integers(3, vocab, n).tolist(),
                           SamplingParams(temperature=0, max_new_tokens=4, ignore_eos=True),
                           adapter=adapter)
    while engine.has_unfinished():
        engine.step()
    sync(engine)
    engine.stats.reset()


def unwrap_lora(model: torch.nn.Module) -> None:
    from slora_core.lora import LoraLinear

    for layer in model.model.layers:  # type: ignore[union-attr]
        for parent, name in ((layer.self_attn, "qkv_proj"), (layer.self_attn, "o_proj"),
                             (layer.mlp, "gate_up_proj"), (layer.mlp, "down_proj")):
            mod = getattr(parent, name)
            if isinstance(mod, LoraLinear):
                setattr(parent, name, mod.base)


class GcPauses:
    """Python garbage collections while active: count per generation, total and longest
    pause (a pause inside the timed window stalls whatever step is running)."""

    def __init__(self) -> None:
        self.counts = [0, 0, 0]
        self.total_s = 0.0
        self.longest_s = 0.0
        self._start = 0.0

    def _callback(self, phase: str, info: dict[str, Any]) -> None:
        if phase == "start":
            self._start = time.perf_counter()
            return
        pause = time.perf_counter() - self._start
        self.counts[info["generation"]] += 1
        self.total_s += pause
        self.longest_s = max(self.longest_s, pause)

    def __enter__(self) -> GcPauses:
        gc.callbacks.append(self._callback)
        return self

    def __exit__(self, *exc: object) -> None:
        gc.callbacks.remove(self._callback)

    def summary(self) -> dict[str, Any]:
        return {"collections_by_generation": self.counts, "pause_s": self.total_s,
                "longest_pause_s": self.longest_s}


def replay(engine: AnyEngine, requests: list[BenchRequest], label: str,
           slo_ttft: float = 6.0, greedy: bool = True) -> dict[str, Any]:
    """Feed requests at their arrival times, step until done; latency and throughput figures."""
    sync(engine)
    compiled = compiled_kernel_variants()
    order = sorted(range(len(requests)), key=lambda i: requests[i].arrival)
    first: dict[int, float] = {}
    done: dict[int, float] = {}
    distinct: list[int] = []
    steps: list[tuple[float, int, int]] = []  # (step wall s, tokens, prompt-chunk tokens)
    tokens: dict[int, list[int]] = {}
    t0 = time.perf_counter()
    nxt = 0
    bar = tqdm(total=len(requests), desc=label, file=sys.stderr, leave=False)
    longest_step = 0.0
    armed = progress = 0.0
    faulthandler.dump_traceback_later(STALL_DUMP_S, repeat=True)
    try:
        with GcPauses() as pauses:
            while len(done) < len(requests):
                now = time.perf_counter() - t0
                while nxt < len(order) and requests[order[nxt]].arrival <= now:
                    i = order[nxt]
                    r = requests[i]
                    params = SamplingParams(temperature=0 if greedy else 1.0,
                                            max_new_tokens=r.output_len, ignore_eos=True,
                                            seed=None if greedy else i)
                    engine.add_request(str(i), r.prompt, params,
                                       adapter=None if r.adapter is None else f"a{r.adapter}")
                    nxt += 1
                if not engine.has_unfinished():  # idle until the next arrival: no stall
                    time.sleep(max(0.0, requests[order[nxt]].arrival - now))
                    progress = armed = time.perf_counter() - t0
                    faulthandler.dump_traceback_later(STALL_DUMP_S, repeat=True)
                    continue
                outs = engine.step()
                t = time.perf_counter() - t0
                longest_step = max(longest_step, t - now)
                distinct.append(engine.stats.last_distinct_adapters)
                steps.append((t - now, engine.stats.last_tokens,
                              engine.stats.last_prefill_tokens))
                if any(out.token_ids for out in outs):
                    progress = t
                    if t - armed > 1.0:  # re-armed about once a second
                        armed = t
                        faulthandler.dump_traceback_later(STALL_DUMP_S, repeat=True)
                elif t - progress > STALL_DUMP_S and t - armed > STALL_DUMP_S:
                    armed = t  # steps return but nothing comes out: say what the engine holds
                    print(f"{label}: no token for {t - progress:.0f} s, {engine.state_snapshot()}",
                          file=sys.stderr, flush=True)
                for out in outs:
                    i = int(out.request_id)
                    if out.token_ids and i not in first:
                        first[i] = t
                    tokens.setdefault(i, []).extend(out.token_ids)
                    if out.finished:
                        done[i] = t
                        bar.update(1)
    finally:
        faulthandler.cancel_dump_traceback_later()
    bar.close()
    wall = time.perf_counter() - t0
    arr = np.array([requests[i].arrival for i in range(len(requests))])
    ttft = np.array([first[i] for i in range(len(requests))]) - arr
    e2e = np.array([done[i] for i in range(len(requests))]) - arr
    toks = np.array([len(tokens.get(i, [])) for i in range(len(requests))])
    tpot = (e2e - ttft)[toks > 1] / (toks[toks > 1] - 1)
    return {
        "label": label, "requests": len(requests), "wall_s": wall,
        "req_per_s": len(requests) / wall, "output_tok_per_s": float(toks.sum() / wall),
        "ttft_s": pct(ttft), "tpot_s": pct(tpot), "e2e_s": pct(e2e),
        "slo_ttft_s": slo_ttft, "slo_attainment": float((ttft <= slo_ttft).mean()),
        "distinct_adapters_per_step_mean": float(np.mean(distinct)) if distinct else 0.0,
        "steps": len(distinct), "preemptions": engine.stats.preemptions,
        "adapter_loads": engine.stats.adapter_loads,
        # Triton variants compiled inside the timed window (each stalls a step): should be 0.
        "kernel_compiles": compiled_kernel_variants() - compiled,
        # The slowest engine.step() call (host wall, from before the arrivals it admitted) and
        # the garbage collector's pauses, for runs whose latency jumps without a cause in sight.
        "longest_step_s": longest_step, "gc": pauses.summary(),
        "step_kinds": step_kinds(steps, distinct),
        # One short digest of each request's tokens: two runs of a greedy workload compare
        # request by request (batches differ with timing, so a rare near-tie may flip).
        "token_digests": [hashlib.sha256(str(tokens.get(i, [])).encode()).hexdigest()[:12]
                          for i in range(len(requests))],
    }


def step_kinds(steps: list[tuple[float, int, int]], distinct: list[int]) -> dict[str, Any]:
    """engine.step() wall time (with asynchronous steps, about the GPU time of the step
    before) for decode-only steps and steps with prompt chunks, each also split at the median
    count of distinct adapters: where a many-adapter run's slower steps come from."""
    if not steps:
        return {}
    wall = np.array([s[0] for s in steps])
    tokens = np.array([s[1] for s in steps])
    mixed = np.array([s[2] > 0 for s in steps])
    adapters = np.array(distinct)
    cut = float(np.median(adapters))
    out: dict[str, Any] = {"adapters_median": cut}
    for kind, sel in (("decode", ~mixed), ("mixed", mixed)):
        for part, sub in (("", sel), ("_few_adapters", sel & (adapters <= cut)),
                          ("_many_adapters", sel & (adapters > cut))):
            if sub.any():
                out[kind + part] = {"steps": int(sub.sum()), "step_s": pct(wall[sub]),
                                    "tokens_mean": float(tokens[sub].mean()),
                                    "adapters_mean": float(adapters[sub].mean())}
    return out


def pct(x: np.ndarray) -> dict[str, float]:
    return {f"p{q}": float(np.percentile(x, q)) for q in (50, 90, 99)} if x.size else {}


def sync(engine: AnyEngine) -> None:
    if engine.arena.pages.is_cuda:
        torch.cuda.synchronize()
