"""Tensor parallelism on GPUs (issue 16): each part writes its JSON under --out-dir as soon as it
finishes, with the commit, the command and the GPUs.

- `7b` (two JSONs from one set of engines): Llama-2-7B shapes (full width; --layers may cut the
  depth, recorded), random weights (`RandomWeights`: every rank makes its own shard on its GPU).
  tp-correctness: greedy, 4 peft adapters written from the HF model and registered by path (every
  rank shard-loads the files), TP=2 tokens against TP=1, each against transformers + peft in the
  same dtype on the same GPU, teacher-forced on the engine's own tokens. tp-throughput: one
  workload (in-memory r16 adapters, all arriving at t=0) through TP=1 eager, TP=1 with decode
  CUDA graphs, TP=2 eager and, last, TP=2 with decode graphs (NCCL inside them: new, so a
  failure there is recorded and the rest kept), with rank 0's host time to send each step.
  Engines that run are checked too (tokens against TP=1 and HF).
- `70b`: a Llama-3-70B-shaped random model at TP=2 with 1,000 rank-16 adapters (a few random
  weight sets, each adapter its own identity and arena pages) on an S-LoRA-style workload
  (Poisson arrivals, power-law adapter popularity): throughput, TTFT and TPOT percentiles.

    python -m bench.tensor_parallel --part 7b --out-dir $OUT
    python -m bench.tensor_parallel --part 70b --out-dir $OUT
    python -m bench.tensor_parallel --smoke --part all --out-dir /tmp/tp   # CPU, gloo, tiny
"""

from __future__ import annotations

import argparse
import gc
import json
import sys
import tempfile
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

import numpy as np
import torch

from bench.numerics_common import ALL_LINEAR, AdapterSpec, EngineRun, run_engine, write_adapters
from bench.replay import pct, replay, unwrap_lora, warm
from bench.run_record import run_record
from bench.tp_reference import against_hf, hf_random_model, tp_vs_tp1, with_adapters
from bench.workload import WorkloadSpec, generate
from devtools.synthetic import seeded_adapter, shared_weight_view
from slora_core.config import EngineConfig, ModelConfig, parse_dtype
from slora_core.engine import LLMEngine
from slora_core.tp import TPGroup, TPShard
from slora_core.tp.launch import start_tp_engine
from slora_core.tp.weights import RandomWeights, random_model_shard

SHAPES: dict[str, dict[str, Any]] = {
    "llama2-7b": dict(hidden_size=4096, intermediate_size=11008, num_hidden_layers=32,
                      num_attention_heads=32, num_key_value_heads=32, vocab_size=32000),
    "llama3-70b": dict(hidden_size=8192, intermediate_size=28672, num_hidden_layers=80,
                       num_attention_heads=64, num_key_value_heads=8, vocab_size=128256,
                       rope_theta=500000.0),
    "tiny": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                 num_attention_heads=4, num_key_value_heads=2, vocab_size=512),
    "tiny-gqa": dict(hidden_size=128, intermediate_size=256, num_hidden_layers=3,
                     num_attention_heads=8, num_key_value_heads=2, vocab_size=1024),
}
ATTN = ("q_proj", "k_proj", "v_proj", "o_proj")
CHECK_ADAPTERS = [AdapterSpec("attn-r16", 16, 32, ATTN), AdapterSpec("all-r16", 16, 32, ALL_LINEAR),
                  AdapterSpec("qv-r8", 8, 16, ("q_proj", "v_proj")),
                  AdapterSpec("rs-all-r32", 32, 64, ALL_LINEAR, rslora=True)]
MAX_MODEL_LEN = 1100
Requests = list[tuple[str, list[int], str | None]]


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
    print(f"{report['seconds']:.0f} s: wrote {path}", flush=True)


def check_requests(vocab: int, adapters: list[str], lengths: list[int]) -> Requests:
    gen = torch.Generator().manual_seed(1)
    prompts = [torch.randint(3, vocab, (n,), generator=gen).tolist() for n in lengths]
    return [(f"{i}-{a}", p, a) for a in [None, *adapters] for i, p in enumerate(prompts)]


def add_workload_adapters(engine: LLMEngine, cfg: ModelConfig, dtype: torch.dtype, n: int,
                          weight_sets: int) -> None:
    """a0..a{n-1}: rank-16 attention adapters over `weight_sets` random weight sets."""
    for i in range(n):
        base = seeded_adapter(cfg, 16, modules=ATTN, dtype=dtype, seed=100 + i % weight_sets)
        engine.add_adapter(f"a{i}", shared_weight_view(base, i))


def timed_replay(engine: LLMEngine, work: list[Any], cfg: ModelConfig, n_adapters: int,
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


def part_7b(args: argparse.Namespace, out: Path) -> None:
    t0 = time.perf_counter()
    cfg, dtype = model_config(args.shape, args.layers), parse_dtype(args.dtype)
    weights, cuda = RandomWeights(cfg, seed=0), args.device.startswith("cuda")
    dev0 = "cuda:0" if cuda else "cpu"
    check: dict[str, Any] = {**record(args, cfg, args.shape), "new_tokens": args.new_tokens,
                             "adapters": [asdict(a) for a in CHECK_ADAPTERS]}
    speed: dict[str, Any] = {**record(args, cfg, args.shape), "runs": {}}
    hf = hf_random_model(weights, dtype, dev0)
    dirs = write_adapters(hf, CHECK_ADAPTERS, Path(tempfile.mkdtemp()), seed=2)
    reqs = check_requests(cfg.vocab_size, list(dirs), args.prompt_lens)
    spec = WorkloadSpec(num_adapters=args.adapters, num_requests=args.requests,
                        vocab_size=cfg.vocab_size, input_range=(8, args.max_input),
                        output_range=(8, args.max_output), seed=3)
    speed["workload"] = asdict(spec)
    work = generate(spec)
    runs: dict[str, EngineRun] = {}
    hf_peft = with_adapters(hf, dirs)  # peft injects its layers in place: hf is this now
    check_path = out / f"tp-correctness-{args.tag}.json"
    speed_path = out / f"tp-throughput-{args.tag}.json"

    def serve(engine: LLMEngine, label: str) -> None:
        """The check requests (compared and saved at once), then the timed workload."""
        for name, path in dirs.items():
            engine.register_adapter(name, path)
        add_workload_adapters(engine, cfg, dtype, args.adapters, args.adapters)
        runs[label] = run = run_engine(engine, reqs, args.new_tokens)
        check.setdefault("vs_hf_same_dtype", {})[label] = against_hf(run, hf_peft, reqs)
        check.setdefault("stats", {})[label] = run.stats
        if label.startswith("tp2"):
            check.update({f"{label}_vs_{k}": tp_vs_tp1(run, runs[k]) for k in runs
                          if k.startswith("tp1")})
        save(check_path, check, t0)
        speed["runs"][label] = timed_replay(engine, work, cfg, args.adapters, label, cuda)
        save(speed_path, speed, t0)

    model = random_model_shard(weights, TPShard(cfg, 0, 1), dtype, dev0, TPGroup(0, 1))
    for label, graphs in [("tp1_eager", False), ("tp1_graphs", True)][: 2 if cuda else 1]:
        unwrap_lora(model)
        serve(LLMEngine(model, cfg, None, engine_config(args, cfg, 1, cuda_graphs=graphs)),
              label)
        gc.collect()
    del model
    gc.collect()
    torch.cuda.empty_cache() if cuda else None
    for label, graphs in [("tp2", False), ("tp2_graphs", True)][: 2 if cuda else 1]:
        try:
            tp = start_tp_engine(weights, engine_config(args, cfg, 2, cuda_graphs=graphs),
                                 detokenize=False, cuda_graphs=graphs)
            try:
                serve(tp, label)
            finally:
                tp.close()
        except Exception as e:  # graphs under TP are new: record a failure, keep the rest
            speed["runs"][label] = check[f"{label}_error"] = f"{type(e).__name__}: {e}"[:2000]
            save(check_path, check, t0)
            if label == "tp2":
                raise
        ratios(speed)
        save(speed_path, speed, t0)


def ratios(speed: dict[str, Any]) -> None:
    """TP=2 throughput over TP=1's, eager over eager and graphs over graphs (and over eager)."""
    runs = {k: r["output_tok_per_s"] for k, r in speed["runs"].items() if isinstance(r, dict)}
    for tp2, tp1 in (("tp2", "tp1_eager"), ("tp2", "tp1_graphs"), ("tp2_graphs", "tp1_graphs"),
                     ("tp2_graphs", "tp2")):
        if tp2 in runs and tp1 in runs:
            speed[f"{tp2}_over_{tp1}"] = runs[tp2] / runs[tp1]


def part_70b(args: argparse.Namespace, out: Path) -> None:
    t0 = time.perf_counter()
    cfg, dtype = model_config(args.big_shape, args.big_layers), parse_dtype(args.dtype)
    report: dict[str, Any] = record(args, cfg, args.big_shape)
    spec = WorkloadSpec(num_adapters=args.big_adapters, num_requests=args.big_requests,
                        alpha=1.0, rate=args.rate, cv=1.0, ranks=(16,),
                        vocab_size=cfg.vocab_size, input_range=(8, args.max_input),
                        output_range=(8, args.max_output), seed=4)
    report.update(workload=asdict(spec), adapter_weight_sets=args.weight_sets)
    engine = start_tp_engine(RandomWeights(cfg, seed=0),
                             engine_config(args, cfg, 2, max_rank=16), detokenize=False)
    path = out / f"tp-70b-{args.tag}.json"
    try:
        report["engine_start_s"] = time.perf_counter() - t0
        add_workload_adapters(engine, cfg, dtype, args.big_adapters, args.weight_sets)
        report.update(num_pages=engine.config.num_pages,
                      adapters_added_s=time.perf_counter() - t0)
        save(path, report, t0)  # a run cut short still says how far it got
        res = timed_replay(engine, generate(spec), cfg, args.big_adapters, "70b-tp2",
                           args.device.startswith("cuda"))
        report["run"] = res
        if args.device.startswith("cuda"):
            report["rank0_max_memory_gb"] = torch.cuda.max_memory_allocated(0) / 2**30
    finally:
        engine.close()
    save(path, report, t0)


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
    args = p.parse_args(argv)
    if args.smoke:
        args.__dict__.update(device="cpu", dtype="float32", shape="tiny", big_shape="tiny-gqa",
                             prompt_lens=[5, 17, 40], new_tokens=4, requests=8, adapters=2,
                             max_input=24, max_output=10, max_num_seqs=8, arena_gb=0.01,
                             big_adapters=20, weight_sets=2, big_requests=8, rate=40.0,
                             tag="smoke")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    out = Path(args.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    if args.device.startswith("cuda"):
        torch.cuda.set_device(0)  # TP=1 runs and TP rank 0 on cuda:0
    if args.part in ("7b", "all"):
        part_7b(args, out)
    if args.part in ("70b", "all"):
        part_70b(args, out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
