"""Tensor parallelism on GPUs (issue 16): each part writes its JSON under --out-dir as soon as it
finishes, with the commit, the command and the GPUs.

- `7b` (two JSONs from one set of engines): Llama-2-7B shapes (full width; --layers may cut the
  depth, recorded), random weights (`RandomWeights`: every rank makes its own shard on its GPU).
  tp-correctness: greedy, 4 peft adapters written from the HF model and registered by path (every
  rank shard-loads the files), TP=2 tokens against TP=1, each against transformers + peft in the
  same dtype on the same GPU, teacher-forced on the engine's own tokens. tp-throughput: one
  workload (in-memory r16 adapters, all arriving at t=0) through TP=1 eager, TP=1 with decode
  CUDA graphs and TP=2 (its ranks run eagerly: the TP graph path was taken out, issue 36),
  with rank 0's host time to send each step.
  Engines that run are checked too (tokens against TP=1 and HF).
- `70b`: a Llama-3-70B-shaped random model at TP=2 with 1,000 rank-16 adapters (a few random
  weight sets, each adapter its own identity and arena pages) on an S-LoRA-style workload
  (Poisson arrivals, power-law adapter popularity): throughput, TTFT and TPOT percentiles.

    python -m bench.tensor_parallel --part 7b --out-dir $OUT
    python -m bench.tensor_parallel --part 70b --out-dir $OUT
    python -m bench.tensor_parallel --smoke --part all --out-dir /tmp/tp   # CPU, gloo, tiny

Every phase logs a timestamped line (stderr), so a run cut short by its time limit says where
it stopped; a phase (on rank 0) or a message from rank 0 (on the other ranks) that takes more
than --stall-dump seconds prints every thread's Python stack, and again each --stall-dump
seconds after (SIGUSR1 prints them at any time; SLORA_TP_DEBUG=1 logs each adapter or arena
message). Keep --collective-timeout and --stall-dump well inside the part's time limit less
its start-up (imports, HF model, ranks: ~40 s at 7B shapes), or neither fires before the
limit kills the part. `--engines` picks the 7b part's engines and their order (`--engines tp2
tp1_eager`: TP=2 before any TP=1 engine touched the GPU); `--check-arena` shrinks each
engine's arena for the correctness requests so that they evict adapters and are preempted.
"""

from __future__ import annotations

import argparse
import faulthandler
import gc
import json
import logging
import os
import signal
import sys
import tempfile
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

import numpy as np
import torch

from bench.numerics_common import ALL_LINEAR, AdapterSpec, EngineRun, run_engine, write_adapters
from bench.replay import pct, replay, warm
from bench.run_record import run_record
from bench.serving import ATTN
from bench.serving import SHAPES as SERVING_SHAPES
from bench.tp_reference import (
    against_hf,
    against_hf_fp32,
    hf_random_model,
    tp_vs_tp1,
    with_adapters,
)
from bench.workload import WorkloadSpec, generate
from devtools.synthetic import seeded_adapter, shared_weight_view
from slora_core.config import EngineConfig, ModelConfig, parse_dtype
from slora_core.engine import LLMEngine
from slora_core.launch import AnyEngine
from slora_core.tp import TPGroup, TPShard
from slora_core.tp.launch import start_tp_engine
from slora_core.tp.weights import RandomWeights, random_model_shard

SHAPES: dict[str, dict[str, Any]] = {
    **SERVING_SHAPES,
    "llama3-70b": dict(hidden_size=8192, intermediate_size=28672, num_hidden_layers=80,
                       num_attention_heads=64, num_key_value_heads=8, vocab_size=128256,
                       rope_theta=500000.0),
    "tiny-gqa": dict(hidden_size=128, intermediate_size=256, num_hidden_layers=3,
                     num_attention_heads=8, num_key_value_heads=2, vocab_size=1024),
}
CHECK_ADAPTERS = [AdapterSpec("attn-r16", 16, 32, ATTN), AdapterSpec("all-r16", 16, 32, ALL_LINEAR),
                  AdapterSpec("qv-r8", 8, 16, ("q_proj", "v_proj")),
                  AdapterSpec("rs-all-r32", 32, 64, ALL_LINEAR, rslora=True)]
MAX_MODEL_LEN = 1100
ENGINES = ("tp1_eager", "tp1_graphs", "tp2")
Requests = list[tuple[str, list[int], str | None]]
log = logging.getLogger("bench.tensor_parallel")
STALL_DUMP_S = 0.0  # --stall-dump (main sets it)


def phase(t0: float, what: str) -> None:
    log.info("%6.1f s  %s", time.perf_counter() - t0, what)
    if STALL_DUMP_S > 0:  # a phase that stalls prints where this process is
        faulthandler.dump_traceback_later(STALL_DUMP_S, repeat=True)


def model_config(shape: str, layers: int | None) -> ModelConfig:
    raw = {"model_type": "llama", "max_position_embeddings": 4096, "rms_norm_eps": 1e-5,
           **SHAPES[shape]}
    if layers:
        raw["num_hidden_layers"] = layers
    return ModelConfig.from_dict(raw)


def engine_config(args: argparse.Namespace, cfg: ModelConfig, tp: int, **over: Any
                  ) -> EngineConfig:
    """The same limits at every TP size; the arena gets --arena-gb on each rank."""
    base = dict(dtype=args.dtype, device=args.device, max_rank=over.pop("max_rank", 32),
                max_num_seqs=args.max_num_seqs, max_adapters_per_batch=args.max_num_seqs,
                max_num_batched_tokens=args.max_batched_tokens, max_model_len=MAX_MODEL_LEN,
                max_queue=100_000, tensor_parallel_size=tp, mixed_graphs=False)
    base.update(over)
    local = TPShard(cfg, 0, tp).engine_config()
    probe = EngineConfig(**base)
    page = (probe.resolve_block_size(local) * local.num_hidden_layers * 2
            * local.num_key_value_heads * local.head_dim * probe.torch_dtype.itemsize)
    return EngineConfig(**base, num_pages=max(64, int(args.arena_gb * 2**30 // page)))


def record(args: argparse.Namespace, cfg: ModelConfig, shape: str) -> dict[str, Any]:
    gpus = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
    return {**run_record(["bench.tensor_parallel", *sys.argv[1:]]), "gpus": gpus,
            "gpu_count": len(gpus), "shape": shape, "model": asdict(cfg) | {"raw": {}},
            "layers_note": ("full depth" if cfg.num_hidden_layers == SHAPES[shape]
                            ["num_hidden_layers"] else f"depth cut to {cfg.num_hidden_layers} "
                            f"layers (full width) to fit the device call"),
            "dtype": args.dtype, "device": args.device}


def save(path: Path, report: dict[str, Any], t0: float) -> None:
    report["seconds"] = time.perf_counter() - t0
    path.write_text(json.dumps(report, indent=1, default=str))
    phase(t0, f"wrote {path}")


def hold_pages(engine: AnyEngine, reqs: Requests, new_tokens: int, scale: float) -> list[int]:
    """Take all but `scale` x the largest single request's pages (KV at its longest + its
    adapter + one more adapter) out of rank 0's free list, so that `reqs` evict adapters and get
    preempted; the other ranks follow rank 0's page numbers. Give them back with pool.free."""
    if scale <= 0:
        return []
    sched, adapters = engine.scheduler, engine.adapters
    pages = [adapters.get(a).layout.num_pages if a else 0 for _, _, a in reqs]
    need = max(sched.blocks_for(len(p) + new_tokens) + n
               for (_, p, _), n in zip(reqs, pages, strict=True))
    budget = int(scale * (need + max(pages)))
    held, evicted = engine.pool.allocate(max(0, engine.pool.num_free - budget))
    assert not evicted, "pages are held before any adapter is resident"
    return held


def check_requests(vocab: int, adapters: list[str], lengths: list[int]) -> Requests:
    gen = torch.Generator().manual_seed(1)
    prompts = [torch.randint(3, vocab, (n,), generator=gen).tolist() for n in lengths]
    return [(f"{i}-{a}", p, a) for a in [None, *adapters] for i, p in enumerate(prompts)]


def add_workload_adapters(engine: AnyEngine, cfg: ModelConfig, dtype: torch.dtype, n: int,
                          weight_sets: int) -> None:
    """a0..a{n-1}: rank-16 attention adapters over `weight_sets` random weight sets."""
    for i in range(n):
        base = seeded_adapter(cfg, 16, modules=ATTN, dtype=dtype, seed=100 + i % weight_sets)
        engine.add_adapter(f"a{i}", shared_weight_view(base, i))


def timed_replay(engine: AnyEngine, work: list[Any], cfg: ModelConfig, n_adapters: int,
                 label: str, cuda: bool) -> dict[str, Any]:
    t0 = time.perf_counter()
    if cuda:  # kernels compiled, graphs captured before the clock
        warm(engine, cfg.vocab_size, n_adapters)
    warm_s = time.perf_counter() - t0
    runner = getattr(engine, "tp_runner", None)
    if runner is not None:
        runner.send_seconds.clear()
    res = replay(engine, work, label)
    res.update(warmup_s=warm_s, stats=asdict(engine.stats))
    if runner is not None and runner.send_seconds:
        sends = np.array(runner.send_seconds)
        res["step_send_host_s"] = {"mean": float(sends.mean()), **pct(sends)}
    return res


def part_7b(args: argparse.Namespace, out: Path) -> bool:
    """True when every engine ran (a failure is recorded in both JSONs and logged)."""
    t0 = time.perf_counter()
    cfg, dtype = model_config(args.shape, args.layers), parse_dtype(args.dtype)
    weights, cuda = RandomWeights(cfg, seed=0), args.device.startswith("cuda")
    dev0 = "cuda:0" if cuda else "cpu"
    check: dict[str, Any] = {**record(args, cfg, args.shape), "new_tokens": args.new_tokens,
                             "adapters": [asdict(a) for a in CHECK_ADAPTERS],
                             "engines": args.engines, "check_arena_scale": args.check_arena}
    speed: dict[str, Any] = {**record(args, cfg, args.shape), "runs": {}}
    phase(t0, "7b: building the HF model")
    hf = hf_random_model(weights, dtype, dev0)
    phase(t0, "7b: writing the peft adapters")
    dirs = write_adapters(hf, CHECK_ADAPTERS, Path(tempfile.mkdtemp()), seed=2)
    reqs = check_requests(cfg.vocab_size, list(dirs), args.prompt_lens)
    spec = WorkloadSpec(num_adapters=args.adapters, num_requests=args.requests,
                        vocab_size=cfg.vocab_size, input_range=(8, args.max_input),
                        output_range=(8, args.max_output), seed=3)
    speed["workload"] = asdict(spec)
    work = generate(spec)
    runs: dict[str, EngineRun] = {}
    phase(t0, "7b: loading the adapters into peft")
    hf_peft = with_adapters(hf, dirs)  # peft injects its layers in place: hf is this now
    check_path = out / f"tp-correctness-{args.tag}.json"
    speed_path = out / f"tp-throughput-{args.tag}.json"

    def serve(engine: AnyEngine, label: str) -> None:
        """The check requests (compared and saved at once), then the timed workload."""
        phase(t0, f"7b {label}: registering {len(dirs)} peft adapters")
        for name, path in dirs.items():
            engine.register_adapter(name, path)
        phase(t0, f"7b {label}: adding {args.adapters} in-memory adapters")
        add_workload_adapters(engine, cfg, dtype, args.adapters, args.adapters)
        held = hold_pages(engine, reqs, args.new_tokens, args.check_arena)
        check.setdefault("check_arena_pages", {})[label] = engine.pool.num_free
        phase(t0, f"7b {label}: {len(reqs)} check requests, {engine.pool.num_free} pages")
        runs[label] = run = run_engine(engine, reqs, args.new_tokens)
        engine.pool.free(held)
        phase(t0, f"7b {label}: comparing with HF")
        check.setdefault("vs_hf_same_dtype", {})[label] = against_hf(run, hf_peft, reqs)
        check.setdefault("stats", {})[label] = run.stats
        for tp2 in (k for k in runs if k.startswith("tp2")):
            check.update({f"{tp2}_vs_{k}": tp_vs_tp1(runs[tp2], runs[k]) for k in runs
                          if k.startswith("tp1")})
        save(check_path, check, t0)
        phase(t0, f"7b {label}: timed workload of {len(work)} requests")
        speed["runs"][label] = timed_replay(engine, work, cfg, args.adapters, label, cuda)
        ratios(speed)
        save(speed_path, speed, t0)

    ok = True
    for label in args.engines:
        graphs = label.endswith("graphs")
        try:
            if label.startswith("tp1"):
                phase(t0, f"7b {label}: building the engine")
                model = random_model_shard(weights, TPShard(cfg, 0, 1), dtype, dev0,
                                           TPGroup(0, 1))
                engine = LLMEngine(model, cfg, None,
                                   engine_config(args, cfg, 1, cuda_graphs=graphs))
                del model  # the engine's only: freed with it
                serve(engine, label)
                del engine
            else:
                phase(t0, f"7b {label}: starting the ranks")
                tp = start_tp_engine(weights, engine_config(args, cfg, 2),
                                     detokenize=False, timeout_s=args.collective_timeout,
                                     stall_dump_s=args.stall_dump or None)
                try:
                    serve(tp, label)
                except BaseException:
                    log.exception("7b %s failed (closing the engine next)", label)
                    raise
                finally:
                    phase(t0, f"7b {label}: closing")
                    tp.close(timeout_s=20.0)
                    phase(t0, f"7b {label}: closed")
        except Exception as e:  # record the failure, run the other engines
            log.exception("7b %s failed", label)
            ok = False
            speed["runs"][label] = check[f"{label}_error"] = f"{type(e).__name__}: {e}"[:2000]
            save(check_path, check, t0)
            save(speed_path, speed, t0)
        gc.collect()  # one engine's weights on the GPU at a time
        torch.cuda.empty_cache() if cuda else None
    if runs:
        # Last: the HF model turns float32 here (the engines are gone; 27 GB at 7B shapes).
        phase(t0, f"7b: {', '.join(runs)} against HF float32, beside HF {args.dtype}'s own")
        check["vs_hf_fp32"] = against_hf_fp32(runs, hf_peft, reqs)
        save(check_path, check, t0)
    return ok


def ratios(speed: dict[str, Any]) -> None:
    """TP=2 throughput over TP=1's, eager and with decode graphs."""
    runs = {k: r["output_tok_per_s"] for k, r in speed["runs"].items() if isinstance(r, dict)}
    for tp2, tp1 in (("tp2", "tp1_eager"), ("tp2", "tp1_graphs")):
        if tp2 in runs and tp1 in runs:
            speed[f"{tp2}_over_{tp1}"] = runs[tp2] / runs[tp1]


def part_70b(args: argparse.Namespace, out: Path) -> bool:
    t0 = time.perf_counter()
    cfg, dtype = model_config(args.big_shape, args.big_layers), parse_dtype(args.dtype)
    report: dict[str, Any] = record(args, cfg, args.big_shape)
    spec = WorkloadSpec(num_adapters=args.big_adapters, num_requests=args.big_requests,
                        alpha=1.0, rate=args.rate, cv=1.0, ranks=(16,),
                        vocab_size=cfg.vocab_size, input_range=(8, args.max_input),
                        output_range=(8, args.max_output), seed=4)
    report.update(workload=asdict(spec), adapter_weight_sets=args.weight_sets)
    phase(t0, "70b: starting the ranks")
    engine = start_tp_engine(RandomWeights(cfg, seed=0),
                             engine_config(args, cfg, 2, max_rank=16), detokenize=False,
                             timeout_s=args.collective_timeout,
                             stall_dump_s=args.stall_dump or None)
    path = out / f"tp-70b-{args.tag}.json"
    try:
        report["engine_start_s"] = time.perf_counter() - t0
        phase(t0, f"70b: adding {args.big_adapters} adapters")
        add_workload_adapters(engine, cfg, dtype, args.big_adapters, args.weight_sets)
        report.update(num_pages=engine.config.num_pages,
                      adapters_added_s=time.perf_counter() - t0)
        save(path, report, t0)  # a run cut short still says how far it got
        phase(t0, f"70b: warm-up and {spec.num_requests} requests")
        res = timed_replay(engine, generate(spec), cfg, args.big_adapters, "70b-tp2",
                           args.device.startswith("cuda"))
        report["run"] = res
        if args.device.startswith("cuda"):
            report["rank0_max_memory_gb"] = torch.cuda.max_memory_allocated(0) / 2**30
        save(path, report, t0)  # before closing: a close that hangs loses nothing
    except BaseException:
        log.exception("70b failed (closing the engine next)")
        raise
    finally:
        phase(t0, "70b: closing")
        engine.close(timeout_s=20.0)
        phase(t0, "70b: closed")
    report["close_s"] = time.perf_counter() - t0 - report["seconds"]
    save(path, report, t0)
    return True


def parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--part", choices=("7b", "70b", "all"), default="all")
    p.add_argument("--out-dir", default="bench/results")
    p.add_argument("--tag", default="h200", help="file name suffix")
    p.add_argument("--smoke", action="store_true", help="CPU, gloo, float32, tiny shapes")
    p.add_argument("--device", default="cuda")
    p.add_argument("--dtype", default="float16")
    p.add_argument("--shape", default="llama2-7b")
    p.add_argument("--layers", type=int, default=None, help="cut the 7B depth (full width)")
    p.add_argument("--prompt-lens", type=int, nargs="+", default=[7, 33, 130, 257, 500])
    p.add_argument("--new-tokens", type=int, default=32)
    p.add_argument("--requests", type=int, default=256)
    p.add_argument("--adapters", type=int, default=8)
    p.add_argument("--max-input", type=int, default=512)
    p.add_argument("--max-output", type=int, default=256)
    p.add_argument("--max-num-seqs", type=int, default=128)
    p.add_argument("--max-batched-tokens", type=int, default=2048)
    p.add_argument("--arena-gb", type=float, default=40.0, help="page arena per rank")
    p.add_argument("--big-shape", default="llama3-70b")
    p.add_argument("--big-layers", type=int, default=None)
    p.add_argument("--big-adapters", type=int, default=1000)
    p.add_argument("--weight-sets", type=int, default=4)
    p.add_argument("--big-requests", type=int, default=300)
    p.add_argument("--rate", type=float, default=5.0, help="70b part: Poisson arrivals/s")
    p.add_argument("--engines", nargs="+", choices=ENGINES, default=None,
                   help="7b part: engines in run order (default: all four, TP=1 first)")
    p.add_argument("--check-arena", type=float, default=1.5,
                   help="7b check requests get this many times the largest request's pages "
                        "(0: the whole arena)")
    p.add_argument("--collective-timeout", type=float, default=600.0,
                   help="seconds a TP collective may wait before NCCL's watchdog ends the run")
    p.add_argument("--stall-dump", type=float, default=30.0,
                   help="print every thread's stack (every rank) after this many seconds "
                        "without progress (0: never)")
    args = p.parse_args(argv)
    if args.smoke:
        args.__dict__.update(device="cpu", dtype="float32", shape="tiny", big_shape="tiny-gqa",
                             prompt_lens=[5, 17, 40], new_tokens=4, requests=8, adapters=2,
                             max_input=24, max_output=10, max_num_seqs=8, arena_gb=0.01,
                             big_adapters=20, weight_sets=2, big_requests=8, rate=40.0,
                             tag="smoke")
    if args.engines is None:
        args.engines = list(ENGINES if args.device.startswith("cuda")
                            else ("tp1_eager", "tp2"))
    return args


def main(argv: list[str] | None = None) -> int:
    global STALL_DUMP_S
    args = parse(argv)
    STALL_DUMP_S = args.stall_dump
    out = Path(args.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    if args.device.startswith("cuda"):
        torch.cuda.set_device(0)  # TP=1 runs and TP rank 0 on cuda:0
    ok = True
    if args.part in ("7b", "all"):
        ok &= part_7b(args, out)
    if args.part in ("70b", "all"):
        ok &= part_70b(args, out)
    return 0 if ok else 1


def run_and_exit() -> None:
    """main(), then exit without interpreter teardown: a process group that could not be
    destroyed (logged by TPGroup.leave) can hang it, and every result is saved by then."""
    logging.basicConfig(level=logging.INFO, stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if os.environ.get("SLORA_TP_DEBUG") == "1":
        logging.getLogger("slora_core.tp").setLevel(logging.DEBUG)
    faulthandler.register(signal.SIGUSR1, all_threads=True)  # where a stuck rank 0 is
    try:
        code = main()
    except SystemExit as e:  # argparse: --help or a bad argument
        code = e.code if isinstance(e.code, int) else 1
    except BaseException:
        log.exception("failed")
        code = 1
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


if __name__ == "__main__":
    run_and_exit()
