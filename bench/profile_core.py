"""Where the engine core's host time goes in one decode step: schedule, memory (adapter copies),
step inputs, launch, sample (synchronous steps on a GPU: this includes waiting for the step's
results), read_wait (asynchronous steps: waiting for the previous step's ids), booking
(scheduler postprocess, outputs) and the output message (encode + ZeroMQ send), timed inside the
real `EngineCore` loop (its phases in the engine's StepLoop) with a real socket, for a batch of
decoding requests. With asynchronous steps also `read_to_send`: from the read of a step's ids
to the start of the send that takes them to the front, with the core's early outputs (sent
before the next sampling, the default) and without (`--early-outputs on,off`: both on one
engine, alternating).

    python -m bench.profile_core --shape llama2-7b --device cuda --dtype float16 --batch 64 \
        [--async-steps] [--early-outputs on,off --repeats 3] \
        --out bench/results/profile-core-h200.json
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import threading
import time
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch
import zmq

import slora_core.model_runner as model_runner
from bench.run_record import run_record
from bench.serving import SHAPES
from devtools.demo_assets import write_demo_assets
from services.worker.engine_core import EngineCore
from slora_core.config import EngineConfig
from slora_core.engine import LLMEngine
from slora_core.sampler import PendingSample
from slora_core.sampling_params import SamplingParams


class PhaseTimer:
    """Wraps callables so each call adds its wall time to a phase of the current step."""

    def __init__(self, sync: bool) -> None:
        self.sync = sync
        self.step: dict[str, float] = defaultdict(float)
        self.stamps: dict[str, float] = {}
        # What each wrap replaced (an owner's own attribute, or None where the name came from
        # its class), so that `restore` leaves nothing wrapped for the next arm.
        self._replaced: list[tuple[Any, str, Any]] = []

    def _replace(self, owner: Any, name: str, new: Callable[..., Any]) -> None:
        self._replaced.append((owner, name, vars(owner).get(name)))
        setattr(owner, name, new)

    def restore(self) -> None:
        for owner, name, old in reversed(self._replaced):
            if old is None:
                delattr(owner, name)
            else:
                setattr(owner, name, old)
        self._replaced.clear()

    def stamp(self, owner: Any, name: str, key: str, at_end: bool) -> None:
        """The current step's first call of `name` (its start, or with `at_end` its end) on
        the step's clock: `read_to_send` is a send's start less the read's end."""
        fn: Callable[..., Any] = getattr(owner, name)

        def stamped(*args: Any, **kwargs: Any) -> Any:
            if not at_end:
                self.stamps.setdefault(key, time.perf_counter())
            try:
                return fn(*args, **kwargs)
            finally:
                if at_end:
                    self.stamps.setdefault(key, time.perf_counter())

        self._replace(owner, name, stamped)

    def wrap(self, owner: Any, name: str, phase: str) -> None:
        fn: Callable[..., Any] = getattr(owner, name)

        def timed(*args: Any, **kwargs: Any) -> Any:
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.step[phase] += (time.perf_counter() - t0) * 1e3

        self._replace(owner, name, timed)


def drain(address: str, stop: threading.Event, ctx: zmq.Context) -> None:
    """The front's end of the output socket: receive and drop."""
    sock = ctx.socket(zmq.PULL)
    sock.bind(address)
    while not stop.is_set():
        if sock.poll(50):
            sock.recv()
    sock.close(linger=0)


def build_engine(args: argparse.Namespace, root: Path) -> tuple[LLMEngine, list[str]]:
    shape = {k: v for k, v in SHAPES[args.shape].items() if k != "vocab_size"}
    shape |= {"head_dim": shape["hidden_size"] // shape["num_attention_heads"],
              "max_position_embeddings": 4096}
    tiny = args.shape == "tiny"
    demo = write_demo_assets(root, seed=0, model_overrides=None if tiny else shape,
                             adapters=("qv-r4", "attn-r8", "all-r16"),
                             dtype=torch.float32 if tiny else torch.float16, device=args.device)
    config = EngineConfig(dtype=args.dtype, device=args.device, num_pages=args.num_pages,
                          max_num_seqs=args.batch, max_num_batched_tokens=2048,
                          async_steps=args.async_steps,
                          max_model_len=None if tiny else args.context + args.steps + 64)
    engine = LLMEngine.from_model_dir(demo.model_dir, config, detokenize=False)
    names = sorted(demo.adapter_dirs)
    for name in names:
        engine.register_adapter(name, root / "adapters" / name)
    engine.warmup()
    return engine, names


def profile(engine: LLMEngine, names: list[str], args: argparse.Namespace, early: bool = True
            ) -> tuple[list[dict], float]:
    """Per-step phase times, and the measured steps' mean wall time (ms) from one clock read
    before the first to one after the last (the device synced at both ends only); `early`:
    the core's early outputs on (its default) or off."""
    ctx = zmq.Context()
    address = f"ipc://{tempfile.mkdtemp()}/out"
    stop = threading.Event()
    drainer = threading.Thread(target=drain, args=(address, stop, ctx))
    drainer.start()
    out = ctx.socket(zmq.PUSH)
    out.connect(address)
    core = EngineCore(engine, out, os.getppid())
    if not early:  # the sends as before: after the step returns
        engine.loop.early_outputs = None
    timer = PhaseTimer(sync=args.device.startswith("cuda"))
    loop = engine.loop  # the step's phases run in its StepLoop
    timer.wrap(loop.scheduler, "schedule", "schedule")
    timer.wrap(loop, "apply_memory_changes", "memory")
    timer.wrap(model_runner, "build_step_inputs", "inputs")
    timer.wrap(loop.runner, "run", "forward_launch")
    timer.wrap(loop.sampler, "sample", "sample")
    timer.wrap(loop.sampler, "sample_async", "sample")
    # Asynchronous steps: waiting for the previous step's ids to land (a bench process of its
    # own: the class is wrapped, as each step makes a new PendingSample).
    timer.wrap(PendingSample, "wait", "read_wait")
    timer.wrap(loop.scheduler, "postprocess", "book")
    timer.wrap(loop, "_append_token", "book")
    timer.wrap(core, "_send", "output_send")
    # From the read of a step's ids (asynchronous steps) to the start of the send that takes
    # them to the front: what a closed-loop client's next request waits for on the core.
    timer.stamp(PendingSample, "result", "read", at_end=True)
    timer.stamp(core, "_send", "send", at_end=False)
    rng = np.random.default_rng(0)
    params = SamplingParams(temperature=0, max_new_tokens=args.warm_steps + args.steps + 4,
                            ignore_eos=True)
    for i in range(args.batch):
        prompt = rng.integers(3, 500, args.context).tolist()
        adapter = names[i % len(names)] if args.adapters else None
        engine.add_request(str(i), prompt, params, adapter=adapter)
    rows = []
    # A sync after every step would let no step overlap the next: with async steps only the
    # warm-up and the end of the window sync, and step_total is the host's time per step.
    sync_each = timer.sync and not args.async_steps
    t_first = 0.0
    try:
        for n in range(args.warm_steps + args.steps):
            if n == args.warm_steps:
                if timer.sync:
                    torch.cuda.synchronize()
                t_first = time.perf_counter()
            timer.step, timer.stamps = defaultdict(float), {}
            t0 = time.perf_counter()
            core._step()
            if sync_each or (timer.sync and n < args.warm_steps):
                torch.cuda.synchronize()
            total = (time.perf_counter() - t0) * 1e3
            if n >= args.warm_steps:
                row = dict(timer.step)
                row["forward_launch"] -= row.get("inputs", 0.0)  # run() builds the inputs
                row["step_total"] = total
                if {"read", "send"} <= timer.stamps.keys():
                    row["read_to_send"] = (timer.stamps["send"] - timer.stamps["read"]) * 1e3
                rows.append(row)
        if timer.sync:
            torch.cuda.synchronize()
        window_ms = (time.perf_counter() - t_first) * 1e3 / args.steps
        for i in range(args.batch):  # the engine serves the next arm from empty
            engine.abort_request(str(i))
        while engine.has_unfinished():
            engine.step()
    finally:
        timer.restore()
        stop.set()
        drainer.join()
        out.close(linger=0)
        ctx.term()
    return rows, window_ms


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--shape", default="tiny", choices=sorted(SHAPES))
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--context", type=int, default=512, help="prompt tokens per request")
    ap.add_argument("--num-pages", type=int, default=2400)
    ap.add_argument("--adapters", action="store_true", help="requests spread over 3 adapters")
    ap.add_argument("--async-steps", action="store_true")
    ap.add_argument("--warm-steps", type=int, default=20, help="prefill and first decode steps")
    ap.add_argument("--steps", type=int, default=50)
    ap.add_argument("--early-outputs", default="on", type=lambda t: t.split(","),
                    help="on: a read step's tokens are sent before the next sampling "
                         "(StepLoop.early_outputs, the core's default); off: after the step "
                         "returns; on,off: both on one engine, alternating --repeats times")
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    if not args.early_outputs or set(args.early_outputs) - {"on", "off"} or args.repeats < 1:
        ap.error("--early-outputs: on, off or on,off; --repeats at least 1")
    result: dict[str, Any] = {
        **run_record(["bench.profile_core", *sys.argv[1:]]), "batch": args.batch,
        "context": args.context, "async_steps": args.async_steps,
        "note": "sample includes waiting for the device (the tokens' copy to the host); with "
                "async steps it waits for the previous step instead, and steps are not synced "
                "one by one (mean_step_ms_window: wall time of the measured steps / their "
                "count); read_to_send: from the read of a step's ids to the start of the send "
                "that carries them",
        "arms": {arm: [] for arm in args.early_outputs}}
    engine, names = build_engine(args, Path(tempfile.mkdtemp(prefix="slora-profile-core-")))
    for r in range(args.repeats):
        for arm in args.early_outputs:
            rows, window_ms = profile(engine, names, args, early=arm == "on")
            phases = sorted({k for row in rows for k in row})
            median = {k: float(np.median([row.get(k, 0.0) for row in rows])) for k in phases}
            result["arms"][arm].append({"repeat": r + 1, "median_ms": median,
                                        "mean_step_ms_window": window_ms, "steps": rows})
            print(f"early outputs {arm}, repeat {r + 1}: median ms per decode step: "
                  + "  ".join(f"{k} {v:.3f}" for k, v in median.items())
                  + f"  | window mean {window_ms:.3f}", flush=True)
            if args.out:
                Path(args.out).write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
