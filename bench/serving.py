"""End-to-end serving benchmark (issue 6): the engine in-process on synthetic Llama shapes with
random weights, S-LoRA-style workloads, and the HF transformers+peft baseline in the same run.

    python -m bench.serving --shape llama2-7b --device cuda --scenarios overhead,scale,peft32,floor,reuse \
        --out bench/results/serving-h200.json

Each scenario prints one table row set; the JSON holds every figure, the command and the hardware.
"""

from __future__ import annotations

import argparse
import faulthandler
import gc
import json
import platform
import signal
import sys
import time
import traceback
from collections.abc import Callable
from dataclasses import asdict
from typing import Any

import numpy as np
import torch

from bench.churn import scenario_churn, scenario_churndisk, scenario_coldttft
from bench.distinct_adapters import (
    ARMS,
    RANKS,
    RIDE_VARIANTS,
    TILE_VARIANTS,
    parse_arms,
    parse_many_arms,
    parse_ride_variants,
    parse_tile_variants,
    scenario_distinct,
)
from bench.distinct_profile import scenario_distinct_profile
from bench.host_sync import scenario_hostsync
from bench.kernels_timing import copy_bandwidth_gbs
from bench.replay import replay, sync, unwrap_lora, warm
from bench.run_record import commit_id
from bench.workload import BenchRequest, WorkloadSpec, generate, reuse_batch
from devtools.synthetic import random_adapter, shared_weight_view
from slora_core.config import EngineConfig, ModelConfig, parse_dtype
from slora_core.engine import LLMEngine
from slora_core.engine_args import add_engine_args, engine_config_kwargs
from slora_core.process import freeze_startup_heap
from slora_core.sampling_params import SamplingParams
from slora_core.weights import build_random_model

SHAPES: dict[str, dict[str, Any]] = {
    "llama2-7b": dict(hidden_size=4096, intermediate_size=11008, num_hidden_layers=32,
                      num_attention_heads=32, num_key_value_heads=32, vocab_size=32000),
    "llama3-8b": dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                      num_attention_heads=32, num_key_value_heads=8, vocab_size=128256,
                      rope_theta=500000.0),
    "tiny": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                 num_attention_heads=4, num_key_value_heads=2, vocab_size=512),
}
ATTN = ("q_proj", "k_proj", "v_proj", "o_proj")


def model_config(shape: str) -> ModelConfig:
    return ModelConfig.from_dict({"model_type": "llama", "max_position_embeddings": 4096,
                                  "rms_norm_eps": 1e-5, **SHAPES[shape]})


class Bench:
    """One random base model on the device, engines built over it per scenario."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.cfg = model_config(args.shape)
        self.dtype = parse_dtype(args.dtype)
        self.model = build_random_model(self.cfg, self.dtype, args.device, seed=0)
        self._base_adapters: dict[int, Any] = {}
        self._last: LLMEngine | None = None  # the latest engine built over self.model
        self.warmup_s: list[float] = []
        # Set by main: writes a scenario's partial result (a run cut short keeps it).
        self.checkpoint: Callable[[str, dict[str, Any]], None] = lambda _name, _part: None

    def engine(self, num_adapters: int, ranks: tuple[int, ...], **overrides: Any) -> LLMEngine:
        a = self.args
        # Namespaces built by other scripts may lack engine flags: EngineConfig's defaults,
        # but this bench's context length.
        kw = {"max_model_len": MAX_MODEL_LEN, **engine_config_kwargs(a),
              "num_pages": self.num_pages(), "max_rank": max(ranks), "max_queue": 100_000}
        kw.update(overrides)
        self.release()
        engine = self._last = LLMEngine(self.model, self.cfg, None, EngineConfig(**kw))
        for i in range(num_adapters):
            rank = ranks[i % len(ranks)]
            if rank not in self._base_adapters:
                self._base_adapters[rank] = random_adapter(
                    self.cfg, rank, modules=ATTN, dtype=self.dtype, seed=rank,
                    pin_memory=self.args.device.startswith("cuda"))
            engine.add_adapter(f"a{i}", shared_weight_view(self._base_adapters[rank], i))
        t0 = time.perf_counter()
        warm(engine, self.cfg.vocab_size, num_adapters)
        self.warmup_s.append(time.perf_counter() - t0)
        freeze_startup_heap()  # as the worker's engine core does once warm
        return engine

    def release(self) -> None:
        """Free the latest engine (arena, graphs, loader threads) before another is built or
        the next scenario starts. `self._last` kept it alive while the next engine allocated its
        arena: `--scenarios overhead,scale --arena-gb 90` ran out of GPU memory on the H200."""
        self.bare_model()
        if self._last is not None:
            self._last.close()
        self._last = None
        gc.unfreeze()  # the engine's objects frozen at start-up become collectable again
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()

    def bare_model(self) -> None:
        """Undo the latest engine's changes to the shared model: a merged adapter
        (merge_sole_adapter) restored, then the LoRA wrapping (each engine wraps the bare base
        layers)."""
        if self._last is not None and self._last.runner.merge is not None:
            self._last.runner.merge.unmerge()
        unwrap_lora(self.model)

    def num_pages(self) -> int:
        page_bytes = (16 * self.cfg.num_hidden_layers * 2 * self.cfg.num_key_value_heads
                      * self.cfg.head_dim * torch.finfo(self.dtype).bits // 8)
        return max(64, int(self.args.arena_gb * 2**30 // page_bytes))


# ---- scenarios -------------------------------------------------------------------------------
def one_adapter_requests(b: Bench) -> list[BenchRequest]:
    """--requests requests, all on adapter a0 (the overhead and gcpause workload)."""
    a = b.args
    return generate(WorkloadSpec(num_adapters=1, num_requests=a.requests,
                                 vocab_size=b.cfg.vocab_size, output_range=(8, a.max_output),
                                 input_range=(8, a.max_input)))


def scenario_overhead(b: Bench) -> dict[str, Any]:
    """Base model alone vs one rank-16 adapter on every request, same requests, interleaved
    repeats (base, adapter, base, adapter, ...) on one engine: a step with no adapter in the
    batch runs the base model's own graphs (LoRA launches nothing), so the base runs are what a
    base-only engine does, and the pairs see the same GPU clocks and the same warmed state.
    With the sole-adapter merge on (the default on one CUDA device, --merge-sole-adapter) each
    repeat also runs the adapter unmerged (the engine's merge switched off for that run), so
    both paths are measured side by side."""
    a = b.args
    reqs = one_adapter_requests(b)
    base_reqs = [BenchRequest(r.arrival, None, r.prompt, r.output_len) for r in reqs]
    engine = b.engine(1, (16,))
    merge = engine.runner.merge
    runs: list[dict[str, Any]] = []
    for i in range(a.overhead_repeats):
        base = replay(engine, base_reqs, f"base {i + 1}")
        lora = replay(engine, reqs, f"one-adapter-r16 {i + 1}")
        run = {"base": base, "one_adapter": lora,
               "throughput_ratio": lora["output_tok_per_s"] / base["output_tok_per_s"]}
        if merge is not None:
            merge.unmerge()
            engine.runner.merge = None
            plain = replay(engine, reqs, f"one-adapter-r16 unmerged {i + 1}")
            engine.runner.merge = merge
            run["one_adapter_unmerged"] = plain
            run["unmerged_ratio"] = plain["output_tok_per_s"] / base["output_tok_per_s"]
        runs.append(run)
    ratios = [r["throughput_ratio"] for r in runs]
    ratio = float(np.median(ratios))
    out: dict[str, Any] = {"repeats": runs, "throughput_ratio": ratio,
                           "ratio_min": min(ratios), "ratio_max": max(ratios), "target": 0.98,
                           "met": ratio >= 0.98, "merge_sole_adapter": merge is not None}
    if merge is not None:
        plain_ratios = [r["unmerged_ratio"] for r in runs]
        out["unmerged"] = {"throughput_ratio": float(np.median(plain_ratios)),
                           "ratio_min": min(plain_ratios), "ratio_max": max(plain_ratios)}
        out["merge"] = {"merges": merge.merges, "restores": merge.restores,
                        "merged_steps": merge.merged_steps, "engine_steps": engine.stats.steps,
                        "refusals": merge.refusals, "merge_seconds": merge.merge_seconds,
                        "peak_restore_bytes": merge.peak_nbytes,
                        "peak_exceptions": merge.peak_exceptions}
    return out


def scenario_gcpause(b: Bench) -> dict[str, Any]:
    """The garbage collector's pauses in the step loop with the start-up heap frozen (what
    Bench.engine and the worker's engine core do once warm: slora_core.process.
    freeze_startup_heap) and not: the overhead scenario's one-adapter requests replayed on one
    engine, interleaved (not frozen, frozen, ...), each replay's collections, pauses, slowest
    step, throughput and TTFT."""
    a = b.args
    reqs = one_adapter_requests(b)
    engine = b.engine(1, (16,))
    keep = ("output_tok_per_s", "ttft_s", "longest_step_s", "gc", "steps")
    runs: list[dict[str, Any]] = []
    for i in range(a.overhead_repeats):
        gc.unfreeze()
        loose = replay(engine, reqs, f"heap not frozen {i + 1}")
        freeze_startup_heap()
        frozen = replay(engine, reqs, f"heap frozen {i + 1}")
        runs.append({"not_frozen": {k: loose[k] for k in keep},
                     "frozen": {k: frozen[k] for k in keep}})

    def medians(arm: str) -> dict[str, float]:
        return {"longest_pause_s": float(np.median([r[arm]["gc"]["longest_pause_s"]
                                                    for r in runs])),
                "pause_s": float(np.median([r[arm]["gc"]["pause_s"] for r in runs])),
                "longest_step_s": float(np.median([r[arm]["longest_step_s"] for r in runs])),
                "output_tok_per_s": float(np.median([r[arm]["output_tok_per_s"]
                                                     for r in runs]))}
    return {"repeats": runs, "not_frozen": medians("not_frozen"), "frozen": medians("frozen")}


def scenario_scale(b: Bench) -> dict[str, Any]:
    """n = 5 vs n = many adapters, ranks {8,16,32,64}, alpha = 1, Gamma arrivals; the many-
    adapter run once per cap on distinct adapters in a batch (`--scale-caps`), since that cap
    trades adapter reads per step against how many requests a step can hold."""
    a = b.args
    ranks = (8, 16, 32, 64)

    def spec(n: int) -> WorkloadSpec:
        return WorkloadSpec(num_adapters=n, num_requests=a.requests, alpha=1.0, rate=a.rate,
                            cv=1.0, ranks=ranks, vocab_size=b.cfg.vocab_size,
                            output_range=(8, a.max_output), input_range=(8, a.max_input))

    few = replay(b.engine(5, ranks), generate(spec(5)), "n=5")
    runs: dict[str, Any] = {"5": few}
    rows = []
    for cap in (int(c) for c in a.scale_caps.split(",")):
        many = replay(b.engine(a.many_adapters, ranks, max_adapters_per_batch=cap),
                      generate(spec(a.many_adapters)), f"n={a.many_adapters} cap={cap}")
        runs[f"{a.many_adapters}-cap{cap}"] = many
        ratio = many["output_tok_per_s"] / few["output_tok_per_s"]
        ttft_ratio = many["ttft_s"]["p99"] / few["ttft_s"]["p99"]
        rows.append({"max_adapters_per_batch": cap, "throughput_ratio": ratio,
                     "p99_ttft_ratio": ttft_ratio,
                     "distinct_adapters_per_step": many["distinct_adapters_per_step_mean"],
                     "met": ratio >= 0.95 and ttft_ratio <= 2.0})
    best = max(rows, key=lambda r: r["throughput_ratio"])
    return {"runs": runs, "by_cap": rows, "throughput_ratio": best["throughput_ratio"],
            "p99_ttft_ratio": best["p99_ttft_ratio"], "best_cap": best["max_adapters_per_batch"],
            "targets": {"throughput_ratio": 0.95, "p99_ttft_ratio": 2.0}, "met": best["met"]}


def scenario_reuse(b: Bench) -> dict[str, Any]:
    """A decode-heavy batch whose adapter reuse share varies (the seed article's claim)."""
    a = b.args
    batch = a.reuse_batch
    rows = []
    for reuse in (0.0, 0.3, 0.5, 0.9, 1.0):
        ids = reuse_batch(batch, reuse, rng_seed=1)
        rng = np.random.default_rng(2)
        reqs = [BenchRequest(0.0, ad, rng.integers(3, b.cfg.vocab_size, 128).tolist(), 128)
                for ad in ids]
        res = replay(b.engine(max(ids) + 1, (16,), max_adapters_per_batch=batch), reqs,
                     f"reuse={reuse}")
        rows.append({"reuse": reuse, "distinct_adapters": len(set(ids)), **res})
    return {"batch": batch, "rows": rows,
            "speedup_at_30pct_vs_0": rows[1]["output_tok_per_s"] / rows[0]["output_tok_per_s"]}


def scenario_peft32(b: Bench) -> dict[str, Any]:
    """32 requests, 32 distinct rank-16 adapters (q,k,v,o), prompt 256, 128 new tokens, greedy."""
    rng = np.random.default_rng(3)
    prompts = [rng.integers(3, b.cfg.vocab_size, 256).tolist() for _ in range(32)]
    reqs = [BenchRequest(0.0, i, p, 128) for i, p in enumerate(prompts)]
    ours = replay(b.engine(32, (16,), max_adapters_per_batch=32), reqs, "ours-32x32")
    out: dict[str, Any] = {"ours": ours}
    if b.args.hf:
        b.bare_model()
        hf = hf_peft_run(b, prompts, 128, b.args.hf_max_time)
        out["hf_peft"] = hf
        out["speedup"] = ours["output_tok_per_s"] / hf["output_tok_per_s"]
        out["target"] = 50.0
        out["met"] = out["speedup"] >= 50.0
    return out


def hf_peft_run(b: Bench, prompts: list[list[int]], new_tokens: int, max_time: float
                ) -> dict[str, Any]:
    """transformers + peft, one mixed-adapter batch via `adapter_names=`, same GPU."""
    from peft import LoraConfig, get_peft_model
    from transformers import LlamaConfig, LlamaForCausalLM

    gc.collect()  # our engine's arena must be gone before the HF model is built
    torch.cuda.empty_cache()

    cfg = b.cfg
    hf_cfg = LlamaConfig(hidden_size=cfg.hidden_size,  # type: ignore[call-arg]
                         intermediate_size=cfg.intermediate_size,
                         num_hidden_layers=cfg.num_hidden_layers,
                         num_attention_heads=cfg.num_attention_heads,
                         num_key_value_heads=cfg.num_key_value_heads, vocab_size=cfg.vocab_size,
                         rope_theta=cfg.rope_theta, max_position_embeddings=4096)
    torch.set_default_dtype(b.dtype)
    with torch.device(b.args.device):
        model = LlamaForCausalLM(hf_cfg)
    torch.set_default_dtype(torch.float32)
    names = [f"a{i}" for i in range(len(prompts))]
    lcfg = LoraConfig(r=16, lora_alpha=32, target_modules=list(ATTN), init_lora_weights=False)
    model = get_peft_model(model, lcfg, adapter_name=names[0])  # type: ignore[assignment]
    for n in names[1:]:
        model.add_adapter(n, lcfg)  # type: ignore[arg-type]
    model = model.to(b.dtype).eval()  # type: ignore[arg-type]
    ids = torch.tensor(prompts, device=b.args.device)
    sync_dev(b.args.device)
    t0 = time.perf_counter()
    with torch.inference_mode():
        out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids),
                             adapter_names=names, max_new_tokens=new_tokens, min_new_tokens=1,
                             do_sample=False, max_time=max_time, pad_token_id=0)
    sync_dev(b.args.device)
    wall = time.perf_counter() - t0
    generated = (out.shape[1] - ids.shape[1]) * ids.shape[0]
    del model
    torch.cuda.empty_cache() if torch.cuda.is_available() else None
    return {"wall_s": wall, "tokens": int(generated), "output_tok_per_s": generated / wall,
            "new_tokens_per_request": int(out.shape[1] - ids.shape[1]),
            "max_time_s": max_time}


def sync_dev(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def copy_bandwidth(device: str) -> float:
    """Device copy bandwidth in bytes/s (read + write), measured as the kernel benchmarks do,
    so floors here and in kernels-h200.json use one ceiling."""
    if not device.startswith("cuda"):
        return float("nan")
    return max(copy_bandwidth_gbs(1 << 30).values()) * 1e9


FLOOR_BATCH, FLOOR_CONTEXT = 64, 512


def floor_engine(b: Bench, new_tokens: int, warm_steps: int,
                 **overrides: Any) -> LLMEngine:
    """The floor scenario's engine: FLOOR_BATCH requests of FLOOR_CONTEXT prompt tokens, each
    on its own rank-16 adapter, every one past its prefill and `warm_steps` decode steps in."""
    batch = FLOOR_BATCH
    engine = b.engine(batch, (16,), max_adapters_per_batch=batch, max_num_seqs=batch,
                      **overrides)
    rng = np.random.default_rng(4)
    for i in range(batch):
        engine.add_request(str(i), rng.integers(3, b.cfg.vocab_size, FLOOR_CONTEXT).tolist(),
                           SamplingParams(temperature=0, max_new_tokens=new_tokens,
                                          ignore_eos=True),
                           adapter=f"a{i}")
    while any(s.num_computed_tokens < len(s.prompt_token_ids) for s in engine.scheduler.running) \
            or engine.num_waiting:
        engine.step()
    for _ in range(warm_steps):
        engine.step()
    return engine


def scenario_floor(b: Bench) -> dict[str, Any]:
    """Decode step time at batch 64 (context ~512, 64 distinct rank-16 adapters) against the
    bytes floor: weights + KV + the step's distinct adapters read once at copy bandwidth."""
    batch, ctx = FLOOR_BATCH, FLOOR_CONTEXT
    engine = floor_engine(b, new_tokens=64, warm_steps=3)
    sync(engine)
    steps = 20
    t0 = time.perf_counter()
    for _ in range(steps):
        engine.step()
    sync(engine)
    step_s = (time.perf_counter() - t0) / steps
    weights = sum(p.numel() * p.element_size() for p in b.model.parameters())
    kv_tokens = sum(s.num_tokens for s in engine.scheduler.running)
    elem = torch.finfo(b.dtype).bits // 8
    kv = kv_tokens * b.cfg.num_hidden_layers * 2 * b.cfg.num_key_value_heads * b.cfg.head_dim * elem
    adapters = batch * random_adapter_bytes(b.cfg, 16, elem)
    bw = copy_bandwidth(b.args.device)
    floor = (weights + kv + adapters) / bw
    return {"batch": batch, "context": ctx, "step_s": step_s, "bytes": {
        "weights": weights, "kv": kv, "adapters": adapters}, "copy_bandwidth_Bps": bw,
        "floor_s": floor, "ratio_to_floor": step_s / floor, "target": 1.3,
        "met": step_s / floor <= 1.3}


def random_adapter_bytes(cfg: ModelConfig, rank: int, elem: int) -> int:
    per_layer = sum(rank * sum(cfg.module_shape(m)) for m in ATTN)
    return per_layer * cfg.num_hidden_layers * elem


SCENARIOS = {"overhead": scenario_overhead, "gcpause": scenario_gcpause,
             "scale": scenario_scale, "reuse": scenario_reuse, "peft32": scenario_peft32,
             "floor": scenario_floor, "churn": scenario_churn, "churndisk": scenario_churndisk,
             "coldttft": scenario_coldttft, "distinct": scenario_distinct,
             "distinct_profile": scenario_distinct_profile, "hostsync": scenario_hostsync}


# The model allows 4096; 1100 fits the longest workload request and keeps graph block tables
# small.
MAX_MODEL_LEN = 1100


def main(argv: list[str] | None = None) -> int:
    # A run cut by its time limit (SIGTERM from `timeout`) prints every thread's stack first:
    # a stalled run then shows where it waited (a compile, a device sync, a lock).
    faulthandler.register(signal.SIGTERM, all_threads=True, chain=True)
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--shape", default="tiny", choices=sorted(SHAPES))
    p.add_argument("--scenarios", default="overhead,scale,reuse,peft32,floor")
    p.add_argument("--arena-gb", type=float, default=40.0,
                   help="page arena size (KV + resident adapters)")
    p.add_argument("--requests", type=int, default=400)
    p.add_argument("--max-input", type=int, default=512)
    p.add_argument("--max-output", type=int, default=512)
    p.add_argument("--rate", type=float, default=8.0, help="arrivals/s for the scale scenario")
    p.add_argument("--many-adapters", type=int, default=2000)
    p.add_argument("--scale-caps", default="64,256",
                   help="max_adapters_per_batch values for the many-adapter runs of 'scale'")
    p.add_argument("--reuse-batch", type=int, default=64)
    p.add_argument("--overhead-repeats", type=int, default=5,
                   help="interleaved base / one-adapter pairs of 'overhead'")
    p.add_argument("--distinct-batch", type=int, default=64,
                   help="requests in one batch of 'distinct' (adapter i %% D)")
    p.add_argument("--distinct-arms", type=parse_arms, default=tuple(ARMS),
                   help="arms of 'distinct' beside base (a subset: a shorter run; the JSON "
                        "says which were left out)")
    p.add_argument("--ride-variants", type=parse_ride_variants, default=(),
                   help="with --ride-sole-adapter: more one-adapter arms riding with other "
                        f"launches ({', '.join(RIDE_VARIANTS)}), side by side")
    p.add_argument("--full-list-arms", type=parse_many_arms, default=(),
                   help="arms of 'distinct' also run with decode graphs' longest tile list "
                        "(the middle list off), side by side")
    p.add_argument("--own-split-arms", type=parse_many_arms, default=(),
                   help="arms of 'distinct' also run with every tile list's K split picked "
                        "for its own length (decode_split_tiles off), side by side")
    p.add_argument("--in-line-arms", type=parse_many_arms, default=(),
                   help="arms of 'distinct' also run with decode graphs' many-adapter LoRA "
                        "shrinks in line after the base GEMMs (lora_fork_shrink off), side "
                        "by side")
    p.add_argument("--two-stage-arms", type=parse_arms, default=(),
                   help="arms of 'distinct' also run with decode graphs' tile lists on two "
                        "pipeline stages (GRAPH_TILE_STAGES off), side by side; one_unmerged "
                        "only on the LoRA kernels (without --ride-sole-adapter)")
    p.add_argument("--mixed-two-stage-arms", type=parse_arms, default=(),
                   help="arms of 'distinct' also run with mixed graphs' 64-row tile lists on "
                        "two pipeline stages (PREFILL_STAGES off), side by side; one_unmerged "
                        "only on the LoRA kernels (without --ride-sole-adapter)")
    p.add_argument("--tile-variant-arms", type=parse_arms, default=(),
                   help="arms of 'distinct' also run with the tile lists launched as each of "
                        "--tile-variants, side by side; one_unmerged only on the "
                        "LoRA kernels (without --ride-sole-adapter)")
    p.add_argument("--tile-variants", type=parse_tile_variants, default=(),
                   help=f"with --tile-variant-arms: {', '.join(TILE_VARIANTS)} (decode "
                        "graphs' lists: a shrink K tile of 128, expand programs of four "
                        "128-column tiles or of one 256-column tile on every list; mixed_*: "
                        "mixed graphs' 64-row lists, expand programs of several column tiles; "
                        "each replaces the lists' own)")
    p.add_argument("--one-adapter-rank", type=int, choices=RANKS, default=RANKS[0],
                   help="rank of the adapter on every request of 'distinct''s one-adapter "
                        "arms (all 7 modules)")
    p.add_argument("--distinct-input", type=int, default=512)
    p.add_argument("--profile-steps", type=int, default=10,
                   help="decode steps timed, then profiled, per arm of 'distinct_profile'")
    p.add_argument("--distinct-output", type=int, default=256)
    p.add_argument("--churn-alphas", type=lambda s: tuple(float(x) for x in s.split(",")),
                   default=(1.0, 0.5), help="popularity skews of 'churn' (1.0 required)")
    p.add_argument("--churn-requests", type=int, default=1000,
                   help="requests of each 'churn' run (alpha 1.0: ~400 distinct of 2,000)")
    p.add_argument("--churn-disk-requests", type=int, default=300,
                   help="requests of the disk-tier run of 'churn'")
    p.add_argument("--churn-rate", type=float, default=60.0, help="arrivals/s in 'churn'")
    p.add_argument("--churn-max-output", type=int, default=128)
    p.add_argument("--churn-host-gb", type=float, default=4.0,
                   help="host tier of the disk variant of 'churn'")
    p.add_argument("--churn-disk-dir", default=None,
                   help="where 'churn' and 'coldttft' write adapter files (default: $TMPDIR)")
    p.add_argument("--hostsync-streams", type=int, default=256,
                   help="closed-loop streams in 'hostsync'")
    p.add_argument("--hostsync-requests-per-stream", type=int, default=4)
    p.add_argument("--hostsync-new-tokens", type=int, default=64)
    p.add_argument("--hostsync-repeats", type=int, default=2)
    p.add_argument("--hf", action="store_true", help="run the HF PEFT baseline in peft32")
    p.add_argument("--hf-max-time", type=float, default=60.0)
    p.add_argument("--out", default=None)
    # num_pages comes from --arena-gb, max_rank from each scenario's adapters.
    # Prefix caching off unless asked (--prefix-caching): these scenarios replay the same
    # requests in repeats (overhead's base / adapter pairs) and compare compute paths, which
    # cached prompts would hide; bench.prefix_cache measures the cache.
    add_engine_args(p, skip=("num_pages", "max_rank", "max_queue"), defaults={
        "dtype": "float16", "device": "cuda" if torch.cuda.is_available() else "cpu",
        "max_num_seqs": 256, "max_num_batched_tokens": 4096, "max_model_len": MAX_MODEL_LEN,
        "prefix_caching": False})
    args = p.parse_args(argv)
    if args.overhead_repeats < 1:
        p.error(f"--overhead-repeats must be 1 or more, got {args.overhead_repeats}")
    if args.distinct_input < 64:  # bench.distinct_adapters draws prompts of 64..input tokens
        p.error(f"--distinct-input must be 64 or more, got {args.distinct_input}")
    if args.profile_steps < 1:
        p.error(f"--profile-steps must be 1 or more, got {args.profile_steps}")
    for flag in ("hostsync_streams", "hostsync_requests_per_stream", "hostsync_new_tokens",
                 "hostsync_repeats"):  # 0 streams would never add a request: no end
        if getattr(args, flag) < 1:
            p.error(f"--{flag.replace('_', '-')} must be 1 or more, got {getattr(args, flag)}")
    if 1.0 not in args.churn_alphas:
        p.error(f"--churn-alphas must include 1.0 (the headline), got {args.churn_alphas}")
    bench = Bench(args)
    results: dict[str, Any] = {
        "command": "python -m bench.serving " + " ".join(argv if argv is not None else sys.argv[1:]),
        "hardware": torch.cuda.get_device_name() if args.device.startswith("cuda")
        else platform.processor() or platform.machine(),
        "commit": commit_id(), "torch": torch.__version__, "args": vars(args), "model": asdict(bench.cfg) | {"raw": {}},
    }
    def write() -> None:
        if args.out:
            with open(args.out, "w") as f:
                json.dump(results, f, indent=1, default=str)

    def checkpoint(name: str, part: dict[str, Any]) -> None:
        results[name] = part
        write()

    bench.checkpoint = checkpoint
    for name in args.scenarios.split(","):
        t0 = time.perf_counter()
        try:
            results[name] = SCENARIOS[name](bench)
        except Exception as e:  # record the failure and go on with the other scenarios
            results[name] = {"error": f"{type(e).__name__}: {e}"[:2000]}
            traceback.print_exc()
        results[name]["scenario_wall_s"] = time.perf_counter() - t0
        results[name]["engine_warmup_s"] = bench.warmup_s
        bench.warmup_s = []
        bench.release()
        print(f"== {name}: {summary(name, results[name])}", flush=True)
        write()
    return 0


def summary(name: str, r: dict[str, Any]) -> str:
    keys = ("throughput_ratio", "p99_ttft_ratio", "speedup", "ratio_to_floor",
            "speedup_at_30pct_vs_0", "met")
    return ", ".join(f"{k}={r[k]:.3f}" if isinstance(r[k], float) else f"{k}={r[k]}"
                     for k in keys if k in r)


if __name__ == "__main__":
    sys.exit(main())
