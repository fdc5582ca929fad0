"""The worker front's own cost over the gateway's mux, on the CPU: how much of a step's time
the front's event loop spends delivering it, and how long a new request waits for that loop.

At 256 streams through the gateway a request's hop from the gateway's entry to the worker's
took 5.1-5.2 ms p50 against 0.8-1.0 ms at 64 on an H100 host
(service-overhead-7b-gw4-admission-spread32-8461c0f-h100.json's hops). Here the real front
code runs in this one process with no gRPC and no engine: the servicer's streams (prompt
checks, detokenizing, chunks) under a real `MuxSession`, either pumped by its writer
(`--deliveries pass`, the front today, a frame every `--pump-ms` of pumping) or a task a
stream (`task`, the front before f33e615), fed by a `CoreClient` whose core is
a stepper task (every `--step-ms` each running request gets one token, its first one step
after it was added, and ends after its `max_new_tokens`), and a closed-loop "gateway" that
sends each finished stream's successor in the next up-frame (each down frame costs its
serialization and a loop turn, as gRPC's write does). Per run: the process's CPU
seconds per step (user + system: the front's loop share at that step time is this over the
step) and, per request, the wait from its up-frame's arrival to `CoreClient.add` (the
front's part of that hop). `--detokenizers rust,python` sets the text window's decoder beside
itself: tokenizers' DecodeStream (the front today) against the same window decoded in Python.

    python -m bench.front_mux_cost --streams 64,256 --deliveries task,pass --pump-ms 0,0.5 \
        --out bench/results/front-mux-pump-<commit>-cpu.json
    python -m bench.front_mux_cost --streams 64,256 --pump-ms 0.5 --detokenizers python,rust \
        --out bench/results/front-mux-detok-<commit>-cpu.json
"""

from __future__ import annotations

import argparse
import asyncio
import cProfile
import io
import json
import pstats
import sys
import tempfile
import time
from collections.abc import AsyncGenerator, AsyncIterator, Sequence
from pathlib import Path
from typing import Any, cast

import numpy as np

from bench.run_record import host_cpu, run_record
from devtools.demo_assets import write_demo_assets
from services.worker import core_protocol as m
from services.worker.core_client import CoreClient
from services.worker.metrics import WorkerMetrics
from services.worker.mux import MuxSession
from services.worker.servicer import WorkerServicer
from slora.v1 import inference_pb2 as pb
from slora_core.config import EngineConfig
from slora_core.tokenizer import Tokenizer


class PythonWindowTokenizer(Tokenizer):
    """A Tokenizer without tokenizers' DecodeStream: TextStream decodes its window in Python
    (the front before it used DecodeStream)."""

    def decode_stream(self, context: Sequence[int], skip_special_tokens: bool = True,
                      ) -> None:
        return None


class FakeCore(CoreClient):
    """A CoreClient whose core is `step()`: nothing is spawned; every added request gets a
    token a step from the next step on, and ends after its max_new_tokens."""

    def __init__(self, model_dir: Path, vocab: int, seed: int = 0) -> None:
        super().__init__(model_dir, EngineConfig(device="cpu"))
        self.ready = m.Ready(max_num_seqs=4096, max_model_len=4096, eos_token_ids=[])
        self.left: dict[int, int] = {}  # rid -> tokens still to send
        self.added_at: dict[tuple[int, ...], float] = {}  # prompt -> when add() took it
        self.rng = np.random.default_rng(seed)
        self.vocab = vocab

    def _send(self, msg: m.ToCore) -> None:  # the core's inputs: kept here
        if isinstance(msg, m.AddRequest):
            self.left[msg.rid] = msg.sampling.max_new_tokens or 16
            self.added_at[tuple(msg.prompt_token_ids)] = time.perf_counter()
        elif isinstance(msg, m.Abort):
            for rid in msg.rids:
                self.left.pop(rid, None)

    wake_slice = 0  # > 0: wake the running streams this many at a time, a loop turn between

    async def _deliver(self, out: m.StepOutput) -> None:
        if not self.wake_slice:
            return await super()._deliver(out)
        _, rest = self._dispatch(out)
        for i in range(0, len(rest), self.wake_slice):
            await asyncio.sleep(0)  # what else is ready (new requests) runs first
            for s in rest[i:i + self.wake_slice]:
                if s.token_ids:  # as CoreClient._deliver: not one a consumer emptied meanwhile
                    s.wake()
        return None

    def step_output(self) -> m.StepOutput:
        rids = list(self.left)
        tokens = self.rng.integers(3, self.vocab, len(rids)).tolist()
        finished = []
        for rid in rids:
            self.left[rid] -= 1
            if self.left[rid] == 0:
                del self.left[rid]
                finished.append(m.Finish(rid, "length"))
        return m.StepOutput(rids, tokens, [0.0] * len(rids), None, finished, [],
                            m.EngineState(running=len(rids)))


async def run(tokenizer: Tokenizer, model_dir: Path, streams: int, step_s: float,
              new_tokens: int, seconds: float, profile: cProfile.Profile | None,
              wake_slice: int = 0, delivery: str = "pass", pump_ms: float = 0.0,
              ) -> dict[str, Any]:
    core = FakeCore(model_dir, min(tokenizer.vocab_size, 500))
    core.wake_slice = wake_slice
    servicer = WorkerServicer("front-mux-cost", core, tokenizer, cast(Any, None),
                              WorkerMetrics())
    frames: asyncio.Queue[pb.MuxUp] = asyncio.Queue()
    sent_at: dict[tuple[int, ...], float] = {}
    count = 0

    def request() -> pb.MuxRequest:
        nonlocal count
        count += 1
        prompt = (1, 3 + count % 400, 3 + count // 400 % 400, 3 + count // 160000, 5, 6, 7, 8)
        sent_at[prompt] = time.perf_counter()
        return pb.MuxRequest(stream_id=count, tenant="t", request=pb.GenerateRequest(
            token_ids=pb.TokenIds(ids=prompt),
            sampling=pb.SamplingOptions(temperature=0, max_new_tokens=new_tokens,
                                        ignore_eos=True)))

    async def up() -> AsyncIterator[pb.MuxUp]:
        while True:
            yield await frames.get()

    stop = asyncio.Event()
    steps = 0

    async def stepper() -> None:
        nonlocal steps
        loop = asyncio.get_running_loop()
        due = loop.time()
        while not stop.is_set():
            due = max(due + step_s, loop.time())
            await asyncio.sleep(due - loop.time())
            await core._deliver(core.step_output())
            steps += 1

    tokens = 0
    frames.put_nowait(pb.MuxUp(requests=[request() for _ in range(streams)]))
    mux = (MuxSession(servicer.serve) if delivery == "task"
           else MuxSession(servicer.serve, servicer.open))
    mux.pump_budget_s = pump_ms / 1e3
    session = mux.frames(up())
    step_task = asyncio.create_task(stepper())
    t0, cpu0 = time.perf_counter(), time.process_time()
    if profile is not None:
        profile.enable()
    async for down in session:  # the gateway's reader: a successor for every end
        down.SerializeToString()  # the worker's part of gRPC's write
        tokens += sum(len(i.response.chunk.token_ids) for i in down.items)
        if down.ends:
            frames.put_nowait(pb.MuxUp(requests=[request() for _ in down.ends]))
        if time.perf_counter() - t0 > seconds:
            break
        await asyncio.sleep(0)  # gRPC's write of a frame awaits: the loop turns between them
    if profile is not None:
        profile.disable()
    wall, cpu = time.perf_counter() - t0, time.process_time() - cpu0
    stop.set()
    await step_task
    await cast(AsyncGenerator[pb.MuxDown, None], session).aclose()  # cancels the streams
    waits = [(core.added_at[p] - sent_at[p]) * 1e3 for p in core.added_at if p in sent_at]
    return {"streams": streams, "delivery": delivery, "wake_slice": wake_slice,
            # What TextStream runs on: Rust only where this tokenizers' DecodeStream primes.
            "detokenizer": "python" if tokenizer.decode_stream([]) is None else "rust",
            "pump_ms": pump_ms, "step_ms": step_s * 1e3,
            "steps": steps, "tokens": tokens,
            "wall_s": wall, "cpu_s": cpu, "cpu_ms_per_step": cpu / steps * 1e3,
            "loop_share": cpu / wall, "requests": len(waits),
            "to_add_ms": {"p50": float(np.percentile(waits, 50)),
                          "p90": float(np.percentile(waits, 90)),
                          "mean": float(np.mean(waits))}}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--streams", default="64,256", help="comma-separated streams in flight")
    ap.add_argument("--step-ms", type=float, default=20.0, help="the fake core's step time")
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--seconds", type=float, default=10.0, help="measured time a level")
    ap.add_argument("--profile", action="store_true", help="print the front's top functions")
    ap.add_argument("--wake-slices", default="0",
                    help="comma-separated variants: 0 wakes a step's running streams at once "
                         "(the front today), N wakes N at a time with a loop turn between")
    ap.add_argument("--deliveries", default="pass",
                    help="comma-separated variants: pass (the writer pumps the streams with "
                         "news: the front today), task (a task a stream, to its end)")
    ap.add_argument("--pump-ms", default="0",
                    help="comma-separated variants of pass: the writer's time a frame "
                         "(MuxSession.pump_budget_s; 0: every stream with news in one frame)")
    ap.add_argument("--detokenizers", default="rust",
                    help="comma-separated variants: rust (tokenizers' DecodeStream decodes the "
                         "text window: the front today), python (the window decoded in Python)")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    try:
        streams = [int(c) for c in args.streams.split(",")]
        slices = [int(w) for w in args.wake_slices.split(",")]
        pumps = [float(p) for p in args.pump_ms.split(",")]
    except ValueError as exc:
        ap.error(f"--streams, --wake-slices and --pump-ms take comma-separated numbers: {exc}")
    # No stream would never end a level; no step or no time would measure nothing.
    deliveries = args.deliveries.split(",")
    if not set(deliveries) <= {"pass", "task"}:
        ap.error(f"--deliveries takes pass and/or task, got {args.deliveries!r}")
    detoks = args.detokenizers.split(",")
    if not set(detoks) <= {"rust", "python"}:
        ap.error(f"--detokenizers takes rust and/or python, got {args.detokenizers!r}")
    if min(streams) < 1 or min(slices) < 0 or min(pumps) < 0:
        ap.error(f"--streams must be 1 or more, --wake-slices and --pump-ms 0 or more, got "
                 f"{args.streams!r}, {args.wake_slices!r} and {args.pump_ms!r}")
    for flag in ("step_ms", "new_tokens", "seconds"):
        if getattr(args, flag) <= 0:
            ap.error(f"--{flag.replace('_', '-')} must be positive, got {getattr(args, flag)}")
    root = Path(tempfile.mkdtemp(prefix="slora-front-mux-"))
    demo = write_demo_assets(root, seed=0, adapters=())
    tokenizers = {"rust": Tokenizer.from_dir(demo.model_dir),
                  "python": PythonWindowTokenizer.from_dir(demo.model_dir)}
    result: dict[str, Any] = {**run_record(["bench.front_mux_cost", *sys.argv[1:]]),
                              "host_cpu": host_cpu(), "levels": []}
    # Slices are the task variant's, pump budgets the pass variant's.
    variants = [(n, w, d, p, t) for n in streams for d in deliveries
                for w in (slices if d == "task" else [0])
                for p in (pumps if d == "pass" else [0.0]) for t in detoks]
    for n, wake_slice, delivery, pump_ms, detok in variants:
        prof = cProfile.Profile() if args.profile else None
        level = asyncio.run(run(tokenizers[detok], demo.model_dir, n, args.step_ms / 1e3,
                                args.new_tokens, args.seconds, prof, wake_slice, delivery,
                                pump_ms))
        result["levels"].append(level)
        how = (f"pumped {pump_ms:g} ms a frame" if delivery == "pass" else
               f"a task each, woken {wake_slice} a turn" if wake_slice else
               "a task each, woken at once")
        print(f"{n} streams {how}, {detok} text window, {args.step_ms:g} ms steps: "
              f"{level['cpu_ms_per_step']:.2f} "
              f"ms CPU a step ({level['loop_share']:.0%} of the loop), up-frame -> add "
              f"p50 {level['to_add_ms']['p50']:.2f} / p90 {level['to_add_ms']['p90']:.2f} ms "
              f"over {level['requests']} requests", flush=True)
        if prof is not None:
            text = io.StringIO()
            pstats.Stats(prof, stream=text).sort_stats("tottime").print_stats(25)
            print(text.getvalue(), flush=True)
        if args.out:
            Path(args.out).write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
