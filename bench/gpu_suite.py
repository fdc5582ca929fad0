"""Engine correctness at real widths under churn, against transformers + peft on the same GPU.

Random-weight (HF init) Llama-2-7B and Llama-3-8B shapes (GQA, 128k vocabulary, rope theta
500k) at full width with fewer layers (`--layers`, recorded), 8 peft adapters of mixed ranks
(4..64) and target sets including two rsLoRA ones, base-model requests beside them, prompts of
17..1,024 tokens and 64 new greedy tokens. The arena is small enough that adapters are
evicted and reloaded from the host tier and sequences are preempted inside the run (counts
asserted > 0; the size comes from simulating the engine's scheduler: `arena_pages`). Modes:
eager, every step a CUDA graph, and the same with asynchronous steps; and the sole-adapter
merge over requests that all share one adapter (merged steps asserted > 0).

Per request, the engine's logits at every generated position are compared with HF + peft fed
the engine's own tokens (teacher forced): relative error against HF in the same dtype, and
greedy agreement with HF float32 next to HF's own same-dtype agreement with float32 (the
yardstick). Tolerance: our error against HF float32 may exceed HF same-dtype's own error
against float32 by at most 50% plus 1e-3 (both are roundings of the same function; a kernel
bug shows up as a far larger error), and our agreement with float32 must be at least HF's,
or short of it by near-ties only (numerics_common.agreement_verdict).

Setup reuses what is in memory: the HF float32 reference wraps the model the checkpoint was
saved from, and the same-dtype one is a device copy of it (reading the 8B checkpoint back with
`from_pretrained` converted gigabytes on the host per dtype). Each phase's seconds are logged
and recorded; `--budget-s` skips (and records) a mode that would not end in time.

    python -m bench.gpu_suite --shapes llama3-8b --out bench/results/gpu-suite-llama3-8b-h200.json
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from bench.numerics_common import (
    ALL_LINEAR,
    AdapterSpec,
    Shape,
    agreement_verdict,
    build_base,
    disagreements,
    hardware,
    hf_logits,
    hf_refs_in_memory,
    make_engine,
    nonfinite_rows,
    rel_err,
    run_engine,
    save_rounded,
    write_adapters,
)
from bench.run_record import commit_id
from slora_core.adapter_cache import AdapterStore
from slora_core.config import EngineConfig, ModelConfig
from slora_core.page_pool import PagePool
from slora_core.prefix_cache import base_identity, lora_identity
from slora_core.sampling_params import SamplingParams
from slora_core.scheduler import Scheduler, SchedulerLimits
from slora_core.sequence import Sequence

ATTN = ("q_proj", "k_proj", "v_proj", "o_proj")
MLP = ("gate_proj", "up_proj", "down_proj")
ADAPTERS = [AdapterSpec("qv-r8", 8, 16, ("q_proj", "v_proj")),
            AdapterSpec("attn-r16", 16, 32, ATTN),
            AdapterSpec("all-r16", 16, 32, ALL_LINEAR),
            AdapterSpec("rslora-all-r32", 32, 64, ALL_LINEAR, rslora=True),
            AdapterSpec("mlp-r64", 64, 128, MLP),
            AdapterSpec("all-r64", 64, 16, ALL_LINEAR),
            AdapterSpec("ko-r4", 4, 8, ("k_proj", "o_proj")),
            AdapterSpec("rslora-qvdown-r8", 8, 16, ("q_proj", "v_proj", "down_proj"), rslora=True)]
PROMPT_LENGTHS = [1024, 17, 700, 333, 129, 64, 900, 512, 250, 1000, 40, 600, 128, 777, 300, 999]
# Synchronous unless named (asynchronous steps are the default on a GPU).
MODES: dict[str, dict[str, Any]] = {"eager": {"cuda_graphs": False, "async_steps": False},
         "all_graphs": {"async_steps": False},
         "all_graphs_async": {"async_steps": True},
         # EngineConfig.merge_sole_adapter, over its own requests: MERGE_REQUESTS prompts all
         # on MERGE_ADAPTER (every module, rsLoRA scale), so most steps run merged.
         "merge_sole_adapter": {"merge_sole_adapter": True},
         # EngineConfig.ride_sole_adapter, the merge off, over the merge's requests: most
         # steps ride (one GEMM with the adapter's A rows appended, one expand); prefill in
         # 256-token chunks, so prompt chunks ride in mixed graphs once the rows are loaded.
         "ride_sole_adapter": {"ride_sole_adapter": True, "merge_sole_adapter": False,
                               "max_num_batched_tokens": 256}}
SOLE_ADAPTER_MODES = ("merge_sole_adapter", "ride_sole_adapter")
DEFAULT_MODES = ("eager", "all_graphs", "all_graphs_async", *SOLE_ADAPTER_MODES)
MERGE_ADAPTER = "rslora-all-r32"
MERGE_REQUESTS = 6
# The engine's limits in every mode (the arena is sized by simulating them).
ENGINE: dict[str, Any] = {"max_num_seqs": 16, "max_num_batched_tokens": 1024,
                          "max_model_len": 2048}


def shapes(layers: int) -> dict[str, Shape]:
    """Full width with `layers` layers; the tiny ones are for a CPU smoke run (with --tiny)."""
    return {"llama2-7b": Shape(f"llama2-7b-{layers}layers", 4096, 11008, layers, 32, 32, 32000),
            "llama3-8b": Shape(f"llama3-8b-{layers}layers", 4096, 14336, layers, 32, 8, 128256,
                               500000.0),
            "tiny-mha": Shape("tiny-mha", 128, 352, 2, 4, 4, 512),
            "tiny-gqa": Shape("tiny-gqa", 128, 352, 2, 4, 2, 640, 500000.0)}


def arena_pages(model_dir: Path, adapters: dict[str, Path], dtype: str, max_rank: int,
                requests: list[tuple[str, list[int], str | None]], new_tokens: int
                ) -> dict[str, Any]:
    """The arena: the largest one, starting from two of the largest adapters plus three of the
    longest requests, whose schedule (the engine's own scheduler, simulated) preempts twice and
    evicts and reloads adapters. The starting size alone preempted no sequence at Llama-3-8B
    width (H200, 8d70290): GQA makes a page hold 128 tokens instead of 32, so the few pages an
    evicted adapter frees hold 4x the KV and 64 new tokens rarely cross a page."""
    mc = ModelConfig.from_hf_dir(model_dir)
    cfg = EngineConfig(dtype=dtype, max_rank=max_rank, **ENGINE)
    block = cfg.resolve_block_size(mc)
    page_numel = block * mc.num_hidden_layers * 2 * mc.num_key_value_heads * mc.head_dim
    store = AdapterStore(mc, max_rank=max_rank, dtype=cfg.torch_dtype, page_numel=page_numel,
                         capacity_bytes=1 << 34)
    pages = {}
    for name, path in adapters.items():
        store.register(name, path)
        pages[name] = store.get(name).layout.num_pages
    longest = max(len(p) for _, p, _ in requests) + new_tokens
    start = 2 * max(pages.values()) + 3 * -(-longest // block)
    for num_pages in range(start, max(pages.values()) + -(-longest // block) - 1, -1):
        churn = simulate_churn(cfg, block, num_pages, requests, pages, new_tokens)
        if (churn["preemptions"] >= 2 and churn["adapter_evictions"] > 0
                and churn["adapter_loads"] > len(adapters)):
            return {"num_pages": num_pages, "block_size": block, "start_pages": start,
                    "adapter_pages": pages, "planned": churn}
    raise RuntimeError(f"no arena of at most {start} pages preempts and evicts")


def simulate_churn(cfg: EngineConfig, block: int, num_pages: int,
                   requests: list[tuple[str, list[int], str | None]], pages: dict[str, int],
                   new_tokens: int) -> dict[str, int]:
    """The run's schedule on the engine's scheduler and page pool alone (torch-free, a few
    milliseconds): with greedy tokens and EOS ignored it depends on no token value, so the
    engine's counts come out the same (eager and graph modes; asynchronous steps add a step)."""
    pool = PagePool(num_pages, num_slots=num_pages)
    sched = Scheduler(SchedulerLimits(block, cfg.max_num_seqs, cfg.max_num_batched_tokens,
                                      cfg.adapter_cap, max_model_len=cfg.max_model_len,
                                      prefix_caching=cfg.prefix_caching), pool, (-1,))
    params = SamplingParams(temperature=0, max_new_tokens=new_tokens, ignore_eos=True)
    for rid, prompt, adapter in requests:
        # The engine's prefix cache too: a preempted request finds its own pages again (the
        # adapters are distinct content, so their names stand for their digests here).
        identity = lora_identity(adapter) if adapter else base_identity("simulated")
        sched.add(Sequence(rid, prompt, params, adapter=adapter,
                           adapter_pages=pages[adapter] if adapter else 0,
                           cache_identity=identity if cfg.prefix_caching else None))
    counts = {"steps": 0, "preemptions": 0, "adapter_loads": 0, "adapter_evictions": 0}
    while sched.has_work() and counts["steps"] < 10 * len(requests) * new_tokens:
        out = sched.schedule(now=0.0)
        counts["steps"] += bool(out.scheduled)
        counts["preemptions"] += len(out.preempted)
        counts["adapter_loads"] += len(out.new_adapters)
        counts["adapter_evictions"] += len(out.evicted)
        sched.postprocess(out.scheduled, [(s.seq, 0) for s in out.scheduled if s.samples])
    return counts


def compare(run: Any, requests: list[tuple[str, list[int], str | None]],
            refs: dict[str, Any], dtype: str, new_tokens: int, mode: str) -> dict[str, Any]:
    per_request = []
    for rid, prompt, adapter in requests:
        toks = run.tokens[rid]
        ids = prompt + toks
        ours = torch.stack(run.logits[rid][: len(toks)])
        ref32 = hf_logits(refs["float32"], adapter, ids[:-1], len(toks))
        ref = hf_logits(refs[dtype], adapter, ids[:-1], len(toks))
        best = ref32.argmax(-1)
        per_request.append({
            "id": rid, "adapter": adapter, "prompt_tokens": len(prompt), "tokens": len(toks),
            "finish_reason": run.finish[rid].finish_reason,
            "rel_err_vs_hf_same_dtype": rel_err(ours, ref),
            "rel_err_vs_hf_fp32": rel_err(ours, ref32),
            "hf_same_dtype_rel_err_vs_fp32": rel_err(ref, ref32),
            "agree_fp32": int((torch.tensor(toks, device=best.device) == best).sum()),
            "hf_agree_fp32": int((ref.argmax(-1) == best).sum()),
            "disagreements": disagreements(toks, ref, ref32),
            "nonfinite_rows": nonfinite_rows(run.logits[rid]),
        })
    return summarize(per_request, run, new_tokens, mode)


def summarize(rows: list[dict[str, Any]], run: Any, new_tokens: int, mode: str
              ) -> dict[str, Any]:
    """The mode's verdict. A merge (ride) mode's run must have run steps merged (ridden): its
    requests share one adapter, no churn to ask for; every other mode's must have evicted,
    reloaded and preempted (the merge may be on there too, by default on a GPU, but its many
    adapters leave it little to merge)."""
    positions = sum(r["tokens"] for r in rows)
    within = all(r["rel_err_vs_hf_fp32"] <= 1.5 * r["hf_same_dtype_rel_err_vs_fp32"] + 1e-3
                 for r in rows)
    agree = sum(r["agree_fp32"] for r in rows) / max(positions, 1)
    hf_agree = sum(r["hf_agree_fp32"] for r in rows) / max(positions, 1)
    verdict = agreement_verdict(
        positions - sum(r["agree_fp32"] for r in rows),
        positions - sum(r["hf_agree_fp32"] for r in rows),
        sum(not d["within_noise"] for r in rows for d in r["disagreements"]))
    s = run.stats
    churn = (s["merged_steps"] > 0 if mode == "merge_sole_adapter" else
             s["ride_steps"] > 0 if mode == "ride_sole_adapter" else
             s["adapter_evictions"] > 0 and s["preemptions"] > 0
             and s["adapter_loads"] > len(ADAPTERS))
    complete = all(r["finish_reason"] == "length" and r["tokens"] == new_tokens for r in rows)
    return {
        "ok": within and verdict["faithful"] and churn and complete,
        "all_finished_with_all_tokens": complete, "logits_within_tolerance": within,
        "max_rel_err_vs_hf_same_dtype": max(r["rel_err_vs_hf_same_dtype"] for r in rows),
        "max_rel_err_vs_hf_fp32": max(r["rel_err_vs_hf_fp32"] for r in rows),
        "max_hf_same_dtype_rel_err_vs_fp32": max(r["hf_same_dtype_rel_err_vs_fp32"]
                                                 for r in rows),
        "greedy_agreement_with_hf_fp32": agree, "hf_same_dtype_agreement_with_hf_fp32": hf_agree,
        "agreement": verdict,
        "positions": positions, "churn_counts_positive": churn, "stats": s,
        "seconds": run.seconds, "requests": rows,
    }


def check_shape(shape: Shape, args: argparse.Namespace, root: Path, out: dict[str, Any],
                save: Callable[[], None]) -> None:
    """Fill `out` for one shape, calling `save` after each mode (a run cut short keeps what is
    done); a mode that would not finish inside `args.budget_s` (judged by the slowest mode so
    far) is recorded as skipped instead of started."""
    t0 = time.perf_counter()
    timings: dict[str, float] = {}

    def lap(name: str, since: float) -> float:
        now = time.perf_counter()
        timings[name] = round(now - since, 2)
        log(f"{shape.name}: {name} {now - since:.1f} s")
        return now

    base = build_base(shape, seed=0, device=args.device)
    t = lap("build_base", t0)
    model_dir = root / shape.name
    save_rounded(base, args.dtype, model_dir)
    t = lap("save_checkpoint", t)
    specs = ADAPTERS if not args.tiny else [AdapterSpec(a.name, min(a.r, 8), a.alpha, a.targets,
                                                        a.rslora) for a in ADAPTERS]
    adapters = write_adapters(base, specs, root / f"{shape.name}-adapters", seed=1)
    t = lap("write_adapters", t)
    gen = torch.Generator().manual_seed(3)
    lengths = PROMPT_LENGTHS if not args.tiny else [n // 16 + 1 for n in PROMPT_LENGTHS]
    names: list[str | None] = [None, *adapters]
    requests = [(f"r{i}", torch.randint(3, shape.vocab, (n,), generator=gen).tolist(),
                 names[i % len(names)]) for i, n in enumerate(lengths)]
    max_rank = max(a.r for a in specs)
    arena = arena_pages(model_dir, adapters, args.dtype, max_rank, requests, args.new_tokens)
    num_pages = arena["num_pages"]
    t = lap("plan_arena", t)
    refs = hf_refs_in_memory(base, adapters, ["float32", args.dtype])
    del base
    t = lap("hf_references", t)
    out.update({"shape": vars(shape), "num_pages": num_pages, "arena": arena,
                "setup_seconds": round(t - t0, 2), "timings": timings, "modes": {}})
    # Off CUDA the graph modes do not exist; the merge runs there too (the smoke test's).
    modes = {m: MODES[m] for m in args.modes
             if args.device == "cuda" or m in SOLE_ADAPTER_MODES}
    if args.device != "cuda":
        modes = {"eager": {}, **modes}
    slowest = 0.0
    for mode, kw in modes.items():
        if time.perf_counter() - args.start + slowest > args.budget_s:
            out["modes"][mode] = {"ok": False, "skipped": f"time budget {args.budget_s:g} s"}
            log(f"{shape.name}: {mode} skipped (time budget)")
            save()
            continue
        m0 = time.perf_counter()
        engine = make_engine(model_dir, args.dtype, args.device, adapters, num_pages=num_pages,
                             max_rank=max_rank, **{**ENGINE, **kw})
        t = lap(f"{mode}.build_engine", m0)
        todo = requests
        if mode in SOLE_ADAPTER_MODES:
            todo = [(f"m{i}", prompt, MERGE_ADAPTER)
                    for i, (_, prompt, _) in enumerate(requests[:MERGE_REQUESTS])]
        run = run_engine(engine, todo, args.new_tokens)
        del engine
        gc.collect()  # its arena and graph pool go now, before the next engine's
        t = lap(f"{mode}.run", t)
        out["modes"][mode] = compare(run, todo, refs, args.dtype, args.new_tokens, mode)
        del run
        lap(f"{mode}.compare", t)
        slowest = max(slowest, time.perf_counter() - m0)
        save()
    del refs


def log(message: str) -> None:
    print(message, flush=True)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--dtype", default="float16")
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--shapes", nargs="+", default=["llama2-7b", "llama3-8b"],
                    choices=list(shapes(1)))
    ap.add_argument("--modes", nargs="+", default=list(DEFAULT_MODES), choices=list(MODES))
    ap.add_argument("--budget-s", type=float, default=math.inf,
                    help="start no mode that would end past this many seconds from start")
    ap.add_argument("--tiny", action="store_true", help="CPU smoke run at toy sizes")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    args.start = time.perf_counter()
    root = Path(tempfile.mkdtemp())
    report: dict[str, Any] = {"command": " ".join(["python -m bench.gpu_suite", *sys.argv[1:]]),
                              "commit": commit_id(), "hardware": hardware(),
                              "torch": torch.__version__, "dtype": args.dtype,
                              "layers": args.layers,
                              "note": "full width, fewer layers than the real models",
                              "adapters": [vars(a) for a in ADAPTERS], "shapes": []}

    def save() -> None:
        report["seconds"] = round(time.perf_counter() - args.start, 1)
        modes = [m for s in report["shapes"] for m in s.get("modes", {}).values()]
        report["ok"] = bool(modes) and all(m["ok"] for m in modes)
        if args.out:
            Path(args.out).write_text(json.dumps(report, indent=1))

    for name in args.shapes:
        report["shapes"].append({})
        check_shape(shapes(args.layers)[name], args, root, report["shapes"][-1], save)
    save()
    print(json.dumps({k: v for k, v in report.items() if k != "shapes"}
                     | {"modes": {s["shape"]["name"]: {m: {k: v for k, v in r.items()
                                                            if k != "requests"}
                                                        for m, r in s["modes"].items()}
                                  for s in report["shapes"]}}, indent=1))
    return 0 if report["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
