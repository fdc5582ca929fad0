"""Does a closed loop of fixed-length requests run in waves? The in-process arm of
bench.service_overhead (`run_in_process` with a StepLog): `concurrency` streams, each adding
its next request before the engine's next step as one finishes, every request asking for
`--new-tokens` (`ignore_eos`) or, with a spread S, new_tokens +- S fixed by its prompt as the
service bench's `--new-tokens-spread` does (`Lengths`). Per step:
how many requests were added before it; per request: how many steps from its add to its first
token. Waves (many adds at few steps) let the in-process loop put a whole wave into one step,
while through the service the hops spread a wave's next requests over milliseconds
(docs/performance.md, issue 37's status).

`--arrive-after-ms D,...`: each arm also with successors that reach the engine D ms after the
step that finished their predecessor returned (`run_in_process(arrive_after_s=)`), as through
a service, TTFT counted from that arrival. In process a successor is added before the very next
step; one that arrives after that step began waits for it to end, so if the closed loop's
successors miss a step through the service, TTFT from arrival rises by about a step less D
(the mean step is recorded beside it).

    python -m bench.closed_loop_waves --arrive-after-ms 0,1,3 \
        --out bench/results/closed-loop-waves-cpu.json
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
from bench.service_overhead import Lengths, StepLog, numbers_arg, run_in_process, workload
from devtools.demo_assets import write_demo_assets
from slora_core.config import EngineConfig
from slora_core.engine import LLMEngine


def run_loop(engine: LLMEngine, concurrency: int, requests: int, new_tokens: int,
             spread: int, arrive_after_ms: float = 0.0) -> dict[str, Any]:
    """bench.service_overhead's in-process closed loop, step by step (its StepLog)."""
    log = StepLog()
    run = run_in_process(engine, workload([], requests, vocab=512), Lengths(new_tokens, spread),
                         concurrency, log=log, arrive_after_s=arrive_after_ms / 1e3)
    busy = [a for a in log.adds if a]
    return {"new_tokens": new_tokens, "spread": spread, "arrive_after_ms": arrive_after_ms,
            "request_ttft_p50_ms": run["request_ttft_p50_s"] * 1e3,
            "request_ttft_p99_ms": run["request_ttft_p99_s"] * 1e3,
            "output_tok_per_s": run["output_tok_per_s"],
            "mean_step_ms": run["wall_s"] / len(log.adds) * 1e3, "steps": len(log.adds),
            "steps_with_adds": len(busy), "requests": requests,
            "adds_per_adding_step": {"median": float(np.median(busy)), "max": max(busy)},
            "adds_histogram": dict(sorted(Counter(busy).items())),
            "steps_add_to_first_token": dict(sorted(log.to_first.items()))}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--concurrency", type=int, default=64)
    ap.add_argument("--requests-per-stream", type=int, default=4)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--spreads", default="0,32",
                    help="comma-separated +- spreads of the requested length, an arm each")
    ap.add_argument("--arrive-after-ms", default="0", type=numbers_arg("delay", "ms", True),
                    help="comma-separated delays from a request's finish to its successor's "
                         "arrival, an arm each per spread (0: added before the next step)")
    ap.add_argument("--repeats", type=int, default=1, help="each arm, interleaved")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    try:
        spreads = [int(x) for x in args.spreads.split(",")]
    except ValueError:
        ap.error(f"--spreads {args.spreads!r} is not comma-separated whole numbers")
    if any(not 0 <= x < args.new_tokens for x in spreads):
        ap.error(f"every spread must be in [0, --new-tokens={args.new_tokens}), got {spreads}")
    if args.repeats < 1:
        ap.error(f"--repeats must be at least 1, got {args.repeats}")
    root = Path(tempfile.mkdtemp(prefix="waves-"))
    demo = write_demo_assets(root / "demo", seed=0)
    config = EngineConfig(device=args.device, max_num_seqs=args.concurrency,
                          max_adapters_per_batch=8, max_queue=4096)
    engine = LLMEngine.from_model_dir(demo.model_dir, config)
    result: dict[str, Any] = {**run_record(["bench.closed_loop_waves", *(argv or sys.argv[1:])]),
                              "concurrency": args.concurrency,
                              "steps_async": config.steps_async, "arms": []}
    run_loop(engine, 8, 16, 4, 0)  # warm-up
    for repeat in range(args.repeats):
        for spread in spreads:
            for delay in args.arrive_after_ms:
                arm = run_loop(engine, args.concurrency,
                               args.concurrency * args.requests_per_stream, args.new_tokens,
                               spread, delay)
                result["arms"].append({"repeat": repeat, **arm})
                print(f"spread +-{spread}, arrive after {delay:g} ms: TTFT p50 "
                      f"{arm['request_ttft_p50_ms']:.1f} ms, mean step "
                      f"{arm['mean_step_ms']:.1f} ms; {arm['steps_with_adds']} of "
                      f"{arm['steps']} steps took adds (median "
                      f"{arm['adds_per_adding_step']['median']:g}); steps from add to first "
                      f"token {arm['steps_add_to_first_token']}", flush=True)
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
