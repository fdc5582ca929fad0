"""fp16/bf16 numerics on a Llama with "massive activations", against transformers + peft.

A small random Llama (HF init, written by transformers) gets a few residual channels that reach
`--massive` (1e3-1e4 in real Llama-2/3 checkpoints) for some tokens: layer 1's MLP routes three
intermediate channels, scaled up, into three hidden channels, calibrated in float32. Adapters
are written by peft: an rsLoRA r32 alpha 64 and an all-linear r16, both sized to move each
layer's output by about its own size. Then, per dtype:

- engine level, eager / all-graphs / asynchronous steps: 72 greedy requests (4 x 6 prompts x base
  and the two adapters); non-finite rows met (each would have been a token before the guard)
  and tokens emitted from non-finite rows (must be 0); greedy agreement with HF fp32 on the
  engine's own trajectory (teacher forced) next to HF fp16/bf16's agreement on the same
  positions; logits error against both;
- op level (eager prefill, one request per adapter): every module's output (norms, q/k/v and
  gate/up projections with their LoRA, attention, MLP, down projection, the residual stream,
  logits) against HF fp32, next to HF in the same dtype, and the first op that goes non-finite;
- the guard (all-graphs mode): an adapter whose scale overflows and a row forced to NaN at a
  request's third token end those two requests in error with no token from a non-finite row;
  the other 71 finish, as faithful to HF fp32 as HF's own dtype.

`ok` in the JSON: every piece ran, no token came from a non-finite row, every guard check held,
and every mode was as faithful as HF (no non-finite row where HF had none, greedy agreement
with HF fp32 at least HF same-dtype's, or short of it only by near-ties: each disagreement is
recorded with HF fp32's top-2 margin and the dtype's logit noise there; see
numerics_common.agreement_verdict). `--pieces` picks what runs (bench.gpu_checks gives the
guard a process of its own); `--budget-s` skips (and records) a piece that would not end in
time; the JSON is rewritten after every piece.

    python -m bench.gpu_numerics --out bench/results/gpu-numerics-h200.json
"""

from __future__ import annotations

import argparse
import dataclasses
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
    Agreement,
    Shape,
    build_base,
    hardware,
    hf_logits,
    hf_with_adapters,
    make_engine,
    nonfinite_rows,
    rel_err,
    run_engine,
    write_adapters,
)
from bench.numerics_ops import compare_ops
from bench.run_record import commit_id

SHAPE = Shape("massive-1024", hidden=1024, inter=2816, layers=4, heads=16, kv_heads=4,
              vocab=8192)
TINY_SHAPE = Shape("tiny", 128, 352, 2, 4, 2, 512)  # CPU smoke runs
ADAPTERS = [AdapterSpec("rslora-r32", 32, 64, ALL_LINEAR, rslora=True),
            AdapterSpec("all-r16", 16, 32, ALL_LINEAR)]
MASSIVE_CHANNELS = ((5, 3), (77, 17), (100, 42))  # (hidden channel, intermediate channel)
# EngineConfig defaults otherwise (as `slora batch` runs: 512-token chunked prefill, 64 seqs).
# Synchronous unless named (asynchronous steps are the default on a GPU).
MODES: dict[str, dict[str, Any]] = {"eager": {"cuda_graphs": False, "async_steps": False},
         "all_graphs": {"async_steps": False},
         "all_graphs_async": {"async_steps": True},
         "all_graphs_one_seq": {"max_num_seqs": 1, "async_steps": False}}
DEFAULT_MODES = tuple(MODES)
# What a run checks (--pieces): each mode's requests against HF, the op-level comparison
# (beside the first mode) and the guard (in guard_mode). bench.gpu_checks splits them over
# processes: the guard's second and third engine did not fit beside all_graphs' compiles.
PIECES = ("modes", "ops", "guard")


def guard_mode(device: str) -> str:
    """The mode the guard runs in: every CUDA graph on a GPU (eager on a CPU)."""
    return "all_graphs" if device == "cuda" else "eager"


@torch.no_grad()
def add_massive_activations(model: Any, prompts: list[list[int]], target: float) -> float:
    """Route intermediate channel j of layer 1's MLP into hidden channel c (both scaled) so the
    largest |residual| over `prompts` is `target`; returns the float32 value reached."""
    mlp = model.model.layers[1].mlp
    for c, j in MASSIVE_CHANNELS:
        mlp.gate_proj.weight[j] *= 8.0
        mlp.up_proj.weight[j] *= 8.0
        mlp.down_proj.weight[:, j] = 0.0
        mlp.down_proj.weight[c, j] = 1.0
    peak = _peak_residual(model, prompts)
    for c, j in MASSIVE_CHANNELS:
        mlp.down_proj.weight[c, j] = target / peak
    return _peak_residual(model, prompts)


def _peak_residual(model: Any, prompts: list[list[int]]) -> float:
    """The largest |residual stream| value after any decoder layer (hooks: HF's last hidden
    state is taken after the final norm)."""
    peaks: list[float] = []

    def hook(module: Any, inputs: Any, output: Any) -> None:
        h = output[0] if isinstance(output, tuple) else output
        peaks.append(float(h.abs().max()))

    handles = [layer.register_forward_hook(hook) for layer in model.model.layers]
    for p in prompts:
        model(torch.tensor([p], device=model.device))
    for h in handles:
        h.remove()
    return max(peaks)


def make_prompts(vocab: int, seed: int, sets: int = 1) -> list[list[int]]:
    """`sets` x six prompts of 7 to 500 random tokens (the last one is the longest)."""
    gen = torch.Generator().manual_seed(seed)
    lengths = [7, 33, 64, 130, 257, 500] * sets
    return [torch.randint(3, vocab, (n,), generator=gen).tolist() for n in lengths]


def check_mode(model_dir: Path, adapters: dict[str, Path], dtype: str, device: str,
               mode: dict[str, Any], requests: list[tuple[str, list[int], str | None]],
               refs: dict[str, Any], new_tokens: int) -> dict[str, Any]:
    engine = make_engine(model_dir, dtype, device, adapters, **mode)
    run = run_engine(engine, requests, new_tokens)
    del engine
    gc.collect()  # its arena and graph pool go now, not at some later allocation
    return {
        "requests": len(requests),
        "nonfinite_rows_met": sum(out.finish_reason == "error" for out in run.finish.values()),
        "tokens_from_nonfinite_rows": sum(nonfinite_rows(run.logits[rid][: len(run.tokens[rid])])
                                          for rid in run.tokens),
        # id "<prompt index>-<adapter>": the message names the output token that failed
        "errored_requests": {r: o.error for r, o in sorted(run.finish.items())
                             if o.finish_reason == "error"},
        **vs_hf(run, requests, refs, dtype), "stats": run.stats,
    }


def vs_hf(run: Any, requests: list[tuple[str, list[int], str | None]], refs: dict[str, Any],
          dtype: str) -> dict[str, Any]:
    """The engine's tokens and logits on its own trajectory (HF teacher forced): greedy
    agreement with HF float32 next to HF same-dtype's, and the logits' relative errors."""
    agreement, hf_nonfinite = Agreement(), 0
    err_same = err_fp32 = err_hf = 0.0
    for rid, prompt, adapter in requests:
        toks = run.tokens[rid]
        if not toks:
            continue
        ids = prompt + toks
        ref32 = hf_logits(refs["float32"], adapter, ids[:-1], len(toks))
        ref = hf_logits(refs[dtype], adapter, ids[:-1], len(toks))
        ours = torch.stack(run.logits[rid][: len(toks)])
        agreement.add(rid, toks, ref, ref32)
        hf_nonfinite += nonfinite_rows(list(ref))
        err_same = max(err_same, rel_err(ours, ref))
        err_fp32 = max(err_fp32, rel_err(ours, ref32))
        err_hf = max(err_hf, rel_err(ref, ref32))
    return {**agreement.summary(), "hf_same_dtype_nonfinite_rows": hf_nonfinite,
            "max_logits_rel_err_vs_hf_same_dtype": err_same,
            "max_logits_rel_err_vs_hf_fp32": err_fp32,
            "max_hf_same_dtype_logits_rel_err_vs_hf_fp32": err_hf}


def check_guard(model_dir: Path, adapters: dict[str, Path], dtype: str, device: str,
                mode: dict[str, Any], requests: list[tuple[str, list[int], str | None]],
                refs: dict[str, Any], new_tokens: int) -> dict[str, Any]:
    """The guard on the GPU: a request on an adapter whose scale overflows float32 (every row
    non-finite from its prefill on), and one whose logits row is set to NaN at its third
    token, next to the other requests. Those others must finish, as faithful to HF as HF's own
    dtype (`others_vs_hf`); whether they equal a run without the two is recorded too, but a
    16-bit GPU run need not be batch-invariant (other batch shapes can pick other GEMM kernels
    and flip a near-tie), so it is not required."""
    clean = run_engine(make_engine(model_dir, dtype, device, adapters, **mode), requests,
                       new_tokens, keep_logits=False)
    engine = make_engine(model_dir, dtype, device, adapters, **mode)
    good = engine.adapters.get(next(iter(adapters))).adapter
    weights = {k: dataclasses.replace(w, scale=1e38) for k, w in good.weights.items()}
    # Other content, so another identity (the engine knows adapters by their digest).
    engine.add_adapter("poison", dataclasses.replace(good, weights=weights,
                                                     sha256=f"{good.sha256}-poison"))
    forced = requests[3][0]
    run = engine.runner.run

    def nan_row(scheduled: Any, patch: Any = None) -> torch.Tensor:
        logits = run(scheduled, patch)
        rows = [s.seq.request_id for s in scheduled if s.samples]
        if forced in rows and len(engine.requests.live[forced].seq.output_token_ids) == 2:
            logits = logits.clone()
            logits[rows.index(forced)] = float("nan")
        return logits

    engine.runner.run = nan_row  # type: ignore[method-assign]
    guarded = run_engine(engine, [*requests, ("poison", requests[-1][1], "poison")],
                         new_tokens)
    del engine.runner.run  # nan_row holds the runner: no reference cycle left behind
    others = [r for r in requests if r[0] != forced]
    return {
        "poisoned_request": _ending(guarded, "poison"),
        "forced_nan_request": _ending(guarded, forced),
        "tokens_from_nonfinite_rows": sum(nonfinite_rows(guarded.logits[r][: len(
            guarded.tokens[r])]) for r in guarded.tokens),
        "others": len(others),
        "others_finished_with_all_tokens": all(
            guarded.finish[r].finish_reason == "length" and len(guarded.tokens[r]) == new_tokens
            for r, _, _ in others),
        "others_equal_clean_run": all(guarded.tokens[r] == clean.tokens[r] for r, _, _ in others),
        "others_vs_hf": vs_hf(guarded, others, refs, dtype),
    }


def _ending(run: Any, rid: str) -> dict[str, Any]:
    out = run.finish[rid]
    return {"finish_reason": out.finish_reason, "error": out.error,
            "tokens": len(run.tokens[rid])}


def check_strength(target: float, args: argparse.Namespace, root: Path,
                   out: dict[str, Any], save: Callable[[], None]) -> None:
    """Fill `out` piece by piece, calling `save` after each (a run cut short keeps the rest).
    A piece that would end past `args.budget_s` (judged by its own time in the previous dtype,
    else by the slowest piece so far) is recorded as skipped instead of started."""
    device = args.device
    shape = TINY_SHAPE if args.tiny else SHAPE
    prompts = make_prompts(shape.vocab, seed=1, sets=1 if args.tiny else args.prompt_sets)
    if args.tiny:
        prompts = [p[:40] for p in prompts]
    base = build_base(shape, seed=0, device=device)
    out.update(target_peak=target, float32_peak_residual=add_massive_activations(
        base, prompts, target), dtypes={})
    model_dir = root / f"model-{target:g}"
    base.save_pretrained(model_dir)
    specs = ADAPTERS if not args.tiny else [AdapterSpec(a.name, min(a.r, 8), a.alpha, a.targets,
                                                        a.rslora) for a in ADAPTERS]
    adapters = write_adapters(base, specs, root / f"adapters-{target:g}", seed=2)
    del base
    requests = [(f"{i}-{a}", p, a) for a in [None, *adapters] for i, p in enumerate(prompts)]
    modes = {m: MODES[m] for m in args.modes} if device == "cuda" else {"eager": {}}
    took: dict[str, float] = {}  # piece -> seconds it last took

    def piece(res: dict[str, Any], key: str, fn: Callable[..., dict[str, Any]],
              *fn_args: Any) -> None:
        t0 = time.perf_counter()
        # Judged by the same piece in the previous dtype, else by the slowest piece so far.
        expected = took.get(key, max(took.values(), default=0.0))
        if t0 - args.start + expected > args.budget_s:
            res[key] = {"skipped": f"time budget {args.budget_s:g} s"}
        else:
            res[key] = fn(*fn_args)
            took[key] = time.perf_counter() - t0
        print(f"{time.perf_counter() - args.start:.0f} s: massive {target:g} "
              f"{list(out['dtypes'])[-1]} {key} {time.perf_counter() - t0:.1f} s", flush=True)
        save()

    for dtype in args.dtypes:
        refs = {d: hf_with_adapters(model_dir, adapters, getattr(torch, d), device)
                for d in ("float32", dtype)}
        res: dict[str, Any] = out["dtypes"].setdefault(dtype, {})
        for name, mode in modes.items():
            if "modes" in args.pieces:
                piece(res, name, check_mode, model_dir, adapters, dtype, device, mode,
                      requests, refs, args.new_tokens)
            if "ops" in args.pieces and name == next(iter(modes)):
                piece(res, "ops", compare_ops, model_dir, adapters, dtype, device, refs,
                      prompts[-1])
            if "guard" in args.pieces and name == guard_mode(device):
                piece(res, "guard", check_guard, model_dir, adapters, dtype, device, mode,
                      requests, refs, args.new_tokens)
        del refs


def faithful(m: dict[str, Any]) -> bool:
    """Greedy agreement with HF float32 as good as HF same-dtype's, near-ties allowed
    (numerics_common.agreement_verdict)."""
    return bool(m["agreement"]["faithful"])


def verdict(report: dict[str, Any]) -> bool:
    """Adds the totals to `report`; True when every piece ran, no token came from a non-finite
    row, every guard check held, and every engine mode was as faithful as HF in its dtype: no
    non-finite row where HF had none, greedy agreement with HF float32 at least HF's own or
    short of it by near-ties only (numerics_common.agreement_verdict)."""
    pieces = [(k, m) for s in report["strengths"] for d in s.get("dtypes", {}).values()
              for k, m in d.items()]
    modes = [m for k, m in pieces if k not in ("ops", "guard") and "skipped" not in m]
    guards = [m for k, m in pieces if k == "guard" and "skipped" not in m]
    bad = sum(m["tokens_from_nonfinite_rows"] for m in modes + guards)
    report["skipped"] = sum("skipped" in m for _, m in pieces)
    planned = report.get("pieces", PIECES)
    # The guard runs in all_graphs (eager on a CPU); a run of other modes has none to run.
    expects_guard = "guard" in planned and report["guard_mode"] in report["modes"]
    report["guard_ok"] = (bool(guards) or not expects_guard) and all(
        g["others_finished_with_all_tokens"] and faithful(g["others_vs_hf"])
        and g["poisoned_request"]["tokens"] == 0
        and g["poisoned_request"]["finish_reason"] == "error"
        and g["forced_nan_request"]["tokens"] == 2
        and g["forced_nan_request"]["finish_reason"] == "error" for g in guards)
    report["faithful_ok"] = (bool(modes) or "modes" not in planned) and all(
        (m["nonfinite_rows_met"] == 0 or m["hf_same_dtype_nonfinite_rows"] > 0) and faithful(m)
        for m in modes)
    report["tokens_from_nonfinite_rows_total"] = bad
    return (bad == 0 and report["guard_ok"] and report["faithful_ok"]
            and report["skipped"] == 0)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--dtypes", nargs="+", default=["float16", "bfloat16"])
    ap.add_argument("--massive", nargs="+", type=float, default=[1e4])
    ap.add_argument("--modes", nargs="+", choices=list(MODES),
                    default=list(DEFAULT_MODES))
    # 4 sets x 6 prompts x 3 adapters x 32 tokens = 2,304 positions: with 288 (1 set, 16
    # tokens) the agreement figures of two 16-bit runs turned on two or three near-ties.
    ap.add_argument("--prompt-sets", type=int, default=4)
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--budget-s", type=float, default=math.inf,
                    help="start no piece that would end past this many seconds from start")
    ap.add_argument("--pieces", nargs="+", choices=PIECES, default=list(PIECES),
                    help="what to check: the modes' requests against HF, the op-level "
                         "comparison (beside the first mode), the guard (in all_graphs on a "
                         "GPU, eager on a CPU)")
    ap.add_argument("--tiny", action="store_true", help="CPU smoke run at toy sizes")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    if ("guard" in args.pieces and args.device == "cuda"
            and guard_mode(args.device) not in args.modes):
        ap.error(f"--pieces guard runs in {guard_mode(args.device)}: add it to --modes")
    args.start = time.perf_counter()
    root = Path(tempfile.mkdtemp())
    report: dict[str, Any] = {"command": " ".join(["python -m bench.gpu_numerics",
                                                   *sys.argv[1:]]), "commit": commit_id(),
                              "hardware": hardware(), "torch": torch.__version__,
                              "shape": vars(TINY_SHAPE if args.tiny else SHAPE),
                              "adapters": [vars(a) for a in ADAPTERS], "strengths": [],
                              "modes": list(args.modes) if args.device == "cuda" else ["eager"],
                              "pieces": list(args.pieces), "guard_mode": guard_mode(args.device)}

    def save() -> None:
        report["seconds"] = round(time.perf_counter() - args.start, 1)
        report["ok"] = verdict(report)
        if args.out:
            Path(args.out).write_text(json.dumps(report, indent=1))

    for target in args.massive:
        report["strengths"].append({})
        check_strength(target, args, root, report["strengths"][-1], save)
    save()
    print(json.dumps(report, indent=1))
    return 0 if report["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
