"""Does a closed loop of fixed-length requests run in waves? The in-process arm of
bench.service_overhead, instrumented: `concurrency` streams, each adding its next request
before the engine's next step as one finishes, every request asking for `--new-tokens`
(`ignore_eos`) or, with `--new-tokens-spread S`, a length drawn from new_tokens +- S. Per step:
how many requests were added before it; per request: how many steps from its add to its first
token. Waves (many adds at few steps) let the in-process loop put a whole wave into one step,
while through the service the hops spread a wave's next requests over milliseconds
(docs/performance.md, issue 37's status).

    python -m bench.closed_loop_waves --out bench/results/closed-loop-waves-cpu.json
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from collections import Counter
from pathlib import Path
from typing import Any

import numpy as np

from bench.run_record import run_record
from bench.service_overhead import workload
from devtools.demo_assets import write_demo_assets
from slora_core.config import EngineConfig
from slora_core.engine import LLMEngine
from slora_core.sampling_params import SamplingParams


def run_loop(engine: LLMEngine, concurrency: int, requests: int, new_tokens: int, spread: int,
             seed: int = 0) -> dict[str, Any]:
    rng = np.random.default_rng(seed)
    reqs = workload([], requests, vocab=512)
    lengths = [new_tokens + int(rng.integers(-spread, spread + 1)) for _ in reqs]
    pending = list(enumerate(reqs))[::-1]
    added_at: dict[str, int] = {}
    adds: list[int] = []
    to_first: Counter[int] = Counter()
    live = step = 0
    while pending or engine.has_unfinished():
        n = 0
        while pending and live < concurrency:
            i, (prompt, _adapter) = pending.pop()
            params = SamplingParams(temperature=0, max_new_tokens=lengths[i], ignore_eos=True)
            engine.add_request(str(i), prompt, params)
            added_at[str(i)] = step
            live, n = live + 1, n + 1
        outs = engine.step()
        step += 1
        adds.append(n)
        for out in outs:
            if out.token_ids and out.request_id in added_at:
                to_first[step - added_at.pop(out.request_id)] += 1
            live -= int(out.finished)
    busy = [a for a in adds if a]
    return {"new_tokens": new_tokens, "spread": spread, "steps": step,
            "steps_with_adds": len(busy), "requests": requests,
            "adds_per_adding_step": {"median": float(np.median(busy)), "max": max(busy)},
            "adds_histogram": dict(sorted(Counter(busy).items())),
            "steps_add_to_first_token": dict(sorted(to_first.items()))}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--concurrency", type=int, default=64)
    ap.add_argument("--requests-per-stream", type=int, default=4)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--spreads", default="0,32",
                    help="comma-separated +- spreads of the requested length, an arm each")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    root = Path(tempfile.mkdtemp(prefix="waves-"))
    demo = write_demo_assets(root / "demo", seed=0)
    config = EngineConfig(device=args.device, max_num_seqs=args.concurrency,
                          max_adapters_per_batch=8, max_queue=4096)
    engine = LLMEngine.from_model_dir(demo.model_dir, config)
    result: dict[str, Any] = {**run_record(["bench.closed_loop_waves", *(argv or sys.argv[1:])]),
                              "concurrency": args.concurrency,
                              "steps_async": config.steps_async, "arms": []}
    for spread in (int(s) for s in args.spreads.split(",")):
        arm = run_loop(engine, args.concurrency, args.concurrency * args.requests_per_stream,
                       args.new_tokens, spread)
        result["arms"].append(arm)
        print(f"spread +-{spread}: {arm['steps_with_adds']} of {arm['steps']} steps took adds "
              f"(median {arm['adds_per_adding_step']['median']:g}, max "
              f"{arm['adds_per_adding_step']['max']}); steps from add to first token "
              f"{arm['steps_add_to_first_token']}", flush=True)
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
