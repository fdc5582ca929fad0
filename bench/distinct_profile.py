"""Where the decode step's time goes with many distinct adapters (issue 37): the batch of
`bench.distinct_adapters` (64 requests, adapter i % D, ranks 8-64 on all seven modules, merge
off) brought to decode, then per arm (base, one adapter, D = 16, D = 64):

- the step's wall time over `--profile-steps` back-to-back steps (CUDA graphs as served),
- the GPU time of those steps by kernel family (torch.profiler; kernels inside graph replays
  included), the busy time and the gaps between kernels, and
- one layer's kernel sequence (name, microseconds) from the middle of a step;
- the same for the batch's prefill (`prefill`: its mixed steps, a second pass of the same
  prompts each asking one token, so that graphs are warm and a ride's rows are loaded), which
  the distinct bench's throughput pays too (5 steps of ~90 ms against 256 of ~8 ms).

With the ride on (`--ride-sole-adapter`), `one_kernels` is the one-adapter arm on the LoRA
kernels (the ride switched off for it), as in the distinct bench.

    python -m bench.serving --shape llama2-7b --device cuda --scenarios distinct_profile \
        --out /tmp/distinct-profile.json

The distinct bench's 0.757x (D = 16) against a bytes bound of 0.920x says the LoRA launches run
well below the base GEMMs' bandwidth; this says which launches and by how much.
"""

from __future__ import annotations

import time
from collections import defaultdict
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from torch.profiler import ProfilerActivity, profile

from bench.distinct_adapters import ARMS, RANKS, distinct_engine, distinct_requests
from bench.kernel_families import family_of
from bench.replay import sync
from slora_core.config import LORA_MODULES
from slora_core.sampling_params import SamplingParams

if TYPE_CHECKING:
    from bench.serving import Bench

# Kernel name fragments by family, first match wins (Triton kernels keep their function names).
FAMILIES = (
    ("lora_rows_shrink", ("_rows_shrink",)), ("lora_rows_expand", ("_rows_expand",)),
    ("lora_shrink", ("_lora_shrink",)), ("lora_expand", ("_lora_expand",)),
    ("attention", ("decode", "prefill", "attention")), ("write_kv", ("write_kv",)),
    ("rmsnorm", ("rms_norm", "rmsnorm")), ("rotary", ("rotary",)), ("silu_mul", ("silu",)),
    ("gemm", ("gemm", "cutlass", "nvjet", "sm90", "xmma", "cublas", "gemv")),
    ("copy_fill", ("copy", "fill", "memcpy", "memset", "elementwise", "index")),
)


def family(name: str) -> str:
    return family_of(name, FAMILIES)


def kernel_events(prof: profile, cuda: bool) -> list[tuple[float, float, str]]:
    """(start us, duration us, name) of every device kernel, in start order (on a machine
    without CUDA, the CPU ops: only to try the script)."""
    kind = torch.autograd.DeviceType.CUDA if cuda else torch.autograd.DeviceType.CPU
    out = []
    for ev in prof.events():
        if ev.device_type == kind and ev.time_range.elapsed_us() > 0:
            out.append((float(ev.time_range.start), float(ev.time_range.elapsed_us()), ev.name))
    out.sort()
    return out


def busy_us(events: list[tuple[float, float, str]]) -> float:
    """The union of the kernels' intervals (kernels overlapping on streams count once)."""
    total, end = 0.0, float("-inf")
    for start, dur, _ in events:
        stop = start + dur
        if stop > end:
            total += stop - max(start, end)
            end = stop
    return total


def one_layer(events: list[tuple[float, float, str]], layers: int) -> list[dict[str, Any]]:
    """The kernels of one layer from the middle of the first profiled step: the step's events
    split into `layers` runs by the attention kernel each layer launches once."""
    attn = [i for i, (_, _, n) in enumerate(events) if family(n) == "attention"]
    if len(attn) < layers // 2 + 2:
        return []
    mid = layers // 2
    lo, hi = attn[mid], attn[mid + 1]
    return [{"name": n[:80], "family": family(n), "us": round(d, 2)}
            for _, d, n in events[lo:hi]]


# Variants of an arm: the same batch with the decode graph's choice between row kernels and
# 16-row tiles moved (DecodeGraphs.row_kernels_max_rows: rows an adapter up to which the row
# kernels run). D = 16 puts 4 rows on each adapter (tiles by default), D = 64 one (rows).
VARIANTS = {"distinct16_rows": ("distinct16", 4), "distinct64_tiles": ("distinct64", 0)}


def profile_arm(b: Bench, engine: Any, name: str, steps: int) -> dict[str, Any]:
    """Bring the arm's batch to decode, then time and profile `steps` decode steps; then
    time and profile its prefill."""
    arm, max_rows = VARIANTS.get(name, ("one_unmerged" if name == "one_kernels" else name, None))
    graphs = engine.runner.graphs
    default_rows = graphs.row_kernels_max_rows if graphs is not None else None
    ride = engine.runner.ride
    if graphs is not None and max_rows is not None:
        graphs.row_kernels_max_rows = max_rows
    if name == "one_kernels":
        engine.runner.ride = None
    try:
        reqs = distinct_requests(b, ARMS.get(arm))
        out = _profile(b, engine, name, reqs, steps)
        out["prefill"] = _profile_prefill(b, engine, name, reqs)
        return out
    finally:
        engine.runner.ride = ride
        if graphs is not None:
            graphs.row_kernels_max_rows = default_rows


def _families(events: list[tuple[float, float, str]], steps: int) -> dict[str, Any]:
    """GPU time and launches a step by kernel family, busy time, span and gaps."""
    by_fam: dict[str, float] = defaultdict(float)
    launches: dict[str, int] = defaultdict(int)
    for _, dur, n in events:
        by_fam[family(n)] += dur / steps
        launches[family(n)] += 1
    span = (events[-1][0] + events[-1][1] - events[0][0]) / steps if events else 0.0
    busy = busy_us(events) / steps
    return {"gpu_us_by_family": {k: round(v, 1) for k, v in
                                 sorted(by_fam.items(), key=lambda kv: -kv[1])},
            "launches_per_step": {k: v // steps for k, v in launches.items()},
            "kernels_per_step": len(events) // steps,
            "gpu_busy_us": round(busy, 1), "gpu_span_us": round(span, 1),
            "gaps_us": round(span - busy, 1)}


def prefilling(engine: Any) -> bool:
    """Whether a request waits or a running one's prompt is not yet all computed."""
    return bool(engine.num_waiting) or any(s.num_computed_tokens < len(s.prompt_token_ids)
                                           for s in engine.scheduler.running)


def _prefill_pass(engine: Any, name: str, reqs: list[Any]) -> int:
    """Add the batch asking one token each and step until every prompt is computed; returns
    the steps taken (the requests are then run out, unprofiled)."""
    for i, r in enumerate(reqs):
        engine.add_request(f"{name}-prefill-{i}", r.prompt,
                           SamplingParams(temperature=0, ignore_eos=True, max_new_tokens=1),
                           adapter=None if r.adapter is None else f"a{r.adapter}")
    steps = 0
    while prefilling(engine):
        engine.step()
        steps += 1
    return steps


def _profile_prefill(b: Bench, engine: Any, name: str, reqs: list[Any]) -> dict[str, Any]:
    """The batch's prefill three times: warm, timed, profiled."""
    cuda = torch.cuda.is_available()
    ride = engine.runner.ride
    for _ in range(2):  # the first pass warms (and lets a ride load its rows)
        sync(engine)
        rode = ride.ride_steps if ride is not None else 0
        t0 = time.perf_counter()
        steps = _prefill_pass(engine, name, reqs)
        sync(engine)
        wall_ms = (time.perf_counter() - t0) * 1e3
        rode = (ride.ride_steps if ride is not None else 0) - rode
        while engine.has_unfinished():
            engine.step()
    with profile(activities=[ProfilerActivity.CUDA if cuda else ProfilerActivity.CPU]) as prof:
        pstep = _prefill_pass(engine, name, reqs)
        sync(engine)
    while engine.has_unfinished():
        engine.step()
    events = kernel_events(prof, cuda)
    return {"steps": steps, "wall_ms": round(wall_ms, 2),
            "step_ms": round(wall_ms / max(steps, 1), 2), "ride_steps": rode,
            **_families(events, max(pstep, 1)),
            "one_layer": one_layer(events, b.cfg.num_hidden_layers)}


def _profile(b: Bench, engine: Any, name: str, reqs: list[Any], steps: int) -> dict[str, Any]:
    a = b.args
    warm_steps = 8
    cuda = torch.cuda.is_available()
    for i, r in enumerate(reqs):
        engine.add_request(f"{name}-{i}", r.prompt,
                           SamplingParams(temperature=0, ignore_eos=True,
                                          max_new_tokens=warm_steps + 2 * steps + 8),
                           adapter=None if r.adapter is None else f"a{r.adapter}")
    while prefilling(engine):
        engine.step()
    for _ in range(warm_steps):  # decode graphs replayed once before timing
        engine.step()
    sync(engine)
    t0 = time.perf_counter()
    for _ in range(steps):
        engine.step()
    sync(engine)
    wall_ms = (time.perf_counter() - t0) * 1e3 / steps
    distinct = engine.stats.last_distinct_adapters
    with profile(activities=[ProfilerActivity.CUDA if cuda else ProfilerActivity.CPU]) as prof:
        for _ in range(steps):
            engine.step()
        sync(engine)
    events = kernel_events(prof, cuda)
    while engine.has_unfinished():
        engine.step()
    return {"decode_step_ms": wall_ms, "distinct_adapters": distinct, **_families(events, steps),
            "one_layer": one_layer(events, b.cfg.num_hidden_layers),
            "batch": a.distinct_batch}


def scenario_distinct_profile(b: Bench) -> dict[str, Any]:
    a = b.args
    engine, merge = distinct_engine(b)  # as in the distinct bench: LoRA unmerged on every arm
    steps = a.profile_steps
    out: dict[str, Any] = {"ranks": RANKS, "modules": list(LORA_MODULES), "steps": steps,
                           "ride_sole_adapter": engine.runner.ride is not None}
    arms = ["base", *a.distinct_arms]
    arms += [v for v, (arm, _) in VARIANTS.items() if arm in a.distinct_arms]
    if engine.runner.ride is not None and "one_unmerged" in arms:
        arms.append("one_kernels")
    for name in arms:
        out[name] = profile_arm(b, engine, name, steps)
        r = out[name]
        print(f"{name:14s} step {r['decode_step_ms']:.2f} ms  busy {r['gpu_busy_us']:.0f} us  "
              f"gaps {r['gaps_us']:.0f} us  {r['gpu_us_by_family']}", flush=True)
        p = r["prefill"]
        print(f"{name:14s} prefill {p['steps']} steps {p['step_ms']:.2f} ms a step "
              f"(rode {p['ride_steps']})  busy {p['gpu_busy_us']:.0f} us  gaps "
              f"{p['gaps_us']:.0f} us  {p['gpu_us_by_family']}", flush=True)
    base_ms = out["base"]["decode_step_ms"]
    out["step_ratio_to_base"] = {n: base_ms / out[n]["decode_step_ms"] for n in arms[1:]}
    base_pf = out["base"]["prefill"]["step_ms"]
    out["prefill_step_ratio_to_base"] = {n: base_pf / out[n]["prefill"]["step_ms"]
                                         for n in arms[1:]}
    out["lora_us_per_step"] = {
        n: round(float(np.sum([v for k, v in out[n]["gpu_us_by_family"].items()
                               if k.startswith("lora")])), 1) for n in arms[1:]}
    engine.runner.merge = merge
    return out
