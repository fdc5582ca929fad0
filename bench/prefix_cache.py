"""Prefix caching on a multi-turn chat workload (issue 33), the cache on and off side by side in
one run over one random base model (Llama-2-7B shapes, fp16, on the GPU).

- `chat`: conversations on 16 adapters (rank 16, attention modules), each turn's prompt the
  shared system prompt, every earlier turn (the user's tokens and the model's own reply) and a
  new user message; a conversation starts at a Poisson arrival, and its next turn arrives a
  think time after the previous reply ended (closed loop: a faster engine gets the next turns
  sooner). Reported per arm: TTFT percentiles (all turns, first turns, later turns), output
  and prompt throughput, the prefix cache's hit rate (prompt tokens found cached / prompt
  tokens admitted), the cached tokens the outputs report, evictions of cold prefix pages and
  of idle adapters, adapter loads, preemptions.
- `unshared`: requests with no common prefix (random prompts on random adapters, all at t=0),
  on the same engine after the chat: what the cache costs when it never hits (host time
  hashing pages, cold pages evicted).

The issue's targets, checked in the JSON (`targets`): chat TTFT p50 at least 3x lower and
output throughput at least 1.5x higher with the cache; unshared throughput at most 1% lower.

    python -m bench.prefix_cache --out bench/results/prefix-cache-h200.json      # H200, ~4-6 min
    python -m bench.prefix_cache --smoke --out /tmp/prefix-cache-smoke.json       # CPU, tiny
"""

from __future__ import annotations

import argparse
import gc
import json
import sys
import time
from dataclasses import asdict, dataclass, field, replace
from typing import Any

import numpy as np
import torch

from bench.replay import pct, sync, unwrap_lora, warm
from bench.run_record import run_record
from bench.serving import ATTN, model_config
from devtools.synthetic import random_adapter, shared_weight_view
from slora_core.config import EngineConfig, ModelConfig, parse_dtype
from slora_core.engine import LLMEngine
from slora_core.engine_args import add_engine_args, engine_config_kwargs
from slora_core.sampling_params import SamplingParams
from slora_core.weights import build_random_model


@dataclass(frozen=True)
class ChatSpec:
    conversations: int = 64
    turns: int = 8
    system_tokens: int = 1000
    adapters: int = 16
    user_tokens: tuple[int, int] = (32, 128)  # uniform [lo, hi) per turn
    output_tokens: tuple[int, int] = (64, 128)
    rate: float = 16.0  # conversation starts per second (Poisson)
    think_s: float = 0.5  # mean think time between a reply and the next turn (exponential)
    seed: int = 0


@dataclass
class Conversation:
    adapter: str
    start: float
    users: list[list[int]]
    outputs: list[int]
    thinks: list[float]
    history: list[int] = field(default_factory=list)
    turn: int = 0
    next_at: float = 0.0


def conversations(spec: ChatSpec, vocab: int) -> list[Conversation]:
    rng = np.random.default_rng(spec.seed)
    system = rng.integers(3, vocab, spec.system_tokens).tolist()
    starts = np.cumsum(rng.exponential(1.0 / spec.rate, spec.conversations))
    out = []
    for c in range(spec.conversations):
        users = [rng.integers(3, vocab, int(rng.integers(*spec.user_tokens))).tolist()
                 for _ in range(spec.turns)]
        conv = Conversation(
            adapter=f"a{c % spec.adapters}", start=float(starts[c]), users=users,
            outputs=[int(rng.integers(*spec.output_tokens)) for _ in range(spec.turns)],
            thinks=rng.exponential(spec.think_s, spec.turns).tolist(), history=list(system))
        conv.next_at = conv.start
        out.append(conv)
    return out


def run_chat(engine: LLMEngine, convs: list[Conversation], label: str) -> dict[str, Any]:
    """Serve every turn of every conversation (closed loop); latency, throughput, cache."""
    sync(engine)
    t0 = time.perf_counter()
    arrival: dict[str, float] = {}
    first: dict[str, float] = {}
    prompts: dict[str, list[int]] = {}
    replies: dict[str, list[int]] = {}
    cached: dict[str, int] = {}
    owner: dict[str, Conversation] = {}
    total = sum(len(c.users) for c in convs)
    done = 0
    while done < total:
        now = time.perf_counter() - t0
        for c, conv in enumerate(convs):
            rid = f"{c}-{conv.turn}"
            if conv.turn < len(conv.users) and conv.next_at <= now and rid not in arrival:
                prompt = conv.history + conv.users[conv.turn]
                params = SamplingParams(temperature=0, ignore_eos=True,
                                        max_new_tokens=conv.outputs[conv.turn])
                engine.add_request(rid, prompt, params, adapter=conv.adapter)
                arrival[rid], prompts[rid], owner[rid] = conv.next_at, prompt, conv
        if not engine.has_unfinished():
            upcoming = [c.next_at for c in convs if c.turn < len(c.users)]
            time.sleep(max(0.0, min(upcoming) - now))
            continue
        outs = engine.step()
        t = time.perf_counter() - t0
        for out in outs:
            if out.token_ids and out.request_id not in first:
                first[out.request_id] = t
            replies.setdefault(out.request_id, []).extend(out.token_ids)
            if out.finished:
                if out.error:
                    raise RuntimeError(f"{label}: request {out.request_id} failed: {out.error}")
                rid, done = out.request_id, done + 1
                cached[rid] = out.cached_tokens
                conv = owner[rid]
                conv.history = prompts[rid] + replies[rid]
                conv.next_at = t + conv.thinks[conv.turn]
                conv.turn += 1
    wall = time.perf_counter() - t0
    st = engine.stats
    ttft = {rid: first[rid] - arrival[rid] for rid in arrival}
    firsts = np.array([v for rid, v in ttft.items() if rid.endswith("-0")])
    laters = np.array([v for rid, v in ttft.items() if not rid.endswith("-0")])
    prompt_tokens = sum(len(p) for p in prompts.values())
    return {
        "label": label, "requests": total, "wall_s": wall,
        "output_tok_per_s": sum(len(r) for r in replies.values()) / wall,
        "prompt_tok_per_s": prompt_tokens / wall,
        "ttft_s": pct(np.array(list(ttft.values()))), "ttft_first_turn_s": pct(firsts),
        "ttft_later_turns_s": pct(laters),
        "prompt_tokens": prompt_tokens, "cached_tokens_reported": sum(cached.values()),
        "prefix_cache_queries": st.prefix_cache_queries,
        "prefix_cache_hits": st.prefix_cache_hits,
        "hit_rate": st.prefix_cache_hits / st.prefix_cache_queries
        if st.prefix_cache_queries else 0.0,
        "evictions": {"prefix_pages": st.prefix_evictions, "adapters": st.adapter_evictions},
        "adapter_loads": st.adapter_loads, "preemptions": st.preemptions, "steps": st.steps,
    }


def run_unshared(engine: LLMEngine, args: argparse.Namespace, vocab: int,
                 label: str) -> dict[str, Any]:
    """Prompts with nothing in common, all at t=0: throughput with nothing to reuse."""
    rng = np.random.default_rng(args.seed + 1)
    lo, hi = args.unshared_input
    t0 = time.perf_counter()
    for i in range(args.unshared_requests):
        prompt = rng.integers(3, vocab, int(rng.integers(lo, hi))).tolist()
        params = SamplingParams(temperature=0, ignore_eos=True,
                                max_new_tokens=int(rng.integers(*args.output_tokens)))
        engine.add_request(f"u{i}", prompt, params, adapter=f"a{i % args.adapters}")
    tokens = 0
    while engine.has_unfinished():
        tokens += sum(len(o.token_ids) for o in engine.step())
    sync(engine)
    wall = time.perf_counter() - t0
    st = engine.stats
    return {"label": label, "requests": args.unshared_requests, "wall_s": wall,
            "output_tok_per_s": tokens / wall, "prefix_cache_hits": st.prefix_cache_hits,
            "evictions": {"prefix_pages": st.prefix_evictions,
                          "adapters": st.adapter_evictions}}


class Engines:
    """One random base model; an engine per arm over it, the previous one freed first."""

    def __init__(self, args: argparse.Namespace, cfg: ModelConfig) -> None:
        self.args, self.cfg = args, cfg
        self.dtype = parse_dtype(args.dtype)
        self.model = build_random_model(cfg, self.dtype, args.device, seed=0)
        self.base = random_adapter(cfg, args.rank, modules=ATTN, dtype=self.dtype, seed=1,
                                   pin_memory=args.device.startswith("cuda"))
        self.last: LLMEngine | None = None

    def build(self, prefix_caching: bool) -> LLMEngine:
        self.release()
        a = self.args
        page_bytes = (16 * self.cfg.num_hidden_layers * 2 * self.cfg.num_key_value_heads
                      * self.cfg.head_dim * self.dtype.itemsize)
        config = EngineConfig(**{**engine_config_kwargs(a), "max_rank": a.rank,
                                 "num_pages": max(64, int(a.arena_gb * 2**30 // page_bytes)),
                                 "max_queue": 100_000, "prefix_caching": prefix_caching})
        engine = self.last = LLMEngine(self.model, self.cfg, None, config)
        for i in range(a.adapters):
            engine.add_adapter(f"a{i}", shared_weight_view(self.base, i))
        if a.device.startswith("cuda"):  # kernels compiled, graphs captured before the clock
            warm(engine, self.cfg.vocab_size, a.adapters)
        else:  # the process's first steps pay one-time costs: not in the first arm's clock
            for i in range(2):
                engine.add_request(f"warm{i}", [5 + i] * 20, SamplingParams(max_new_tokens=2),
                                   adapter=f"a{i % a.adapters}")
            while engine.has_unfinished():
                engine.step()
        engine.stats.reset()
        return engine

    def release(self) -> None:
        if self.last is not None:
            if self.last.runner.merge is not None:
                self.last.runner.merge.unmerge()
            self.last.close()
        self.last = None
        unwrap_lora(self.model)
        # The engine sits in reference cycles (and in the heap warm-up froze): without a
        # collection its 80 GB arena outlived it and the second arm's ran out of memory (H200).
        gc.unfreeze()
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()


def ratios(on: dict[str, Any], off: dict[str, Any]) -> dict[str, float]:
    return {"ttft_p50_off_over_on": off["ttft_s"]["p50"] / on["ttft_s"]["p50"],
            "output_throughput_on_over_off": on["output_tok_per_s"] / off["output_tok_per_s"]}


def parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--smoke", action="store_true",
                   help="tiny shape on the CPU, 4 conversations of 3 turns (checks it runs)")
    p.add_argument("--shape", default="llama2-7b")
    p.add_argument("--arena-gb", type=float, default=80.0,
                   help="page arena (KV, cached prefixes, adapters); 7B fp16: 8 MiB a page")
    p.add_argument("--conversations", type=int, default=64)
    p.add_argument("--turns", type=int, default=8)
    p.add_argument("--system-tokens", type=int, default=1000)
    p.add_argument("--adapters", type=int, default=16)
    p.add_argument("--rank", type=int, default=16)
    p.add_argument("--rate", type=float, default=16.0, help="conversation starts per second")
    p.add_argument("--think-s", type=float, default=0.5, help="mean think time between turns")
    p.add_argument("--user-tokens", type=int, nargs=2, default=(32, 128))
    p.add_argument("--output-tokens", type=int, nargs=2, default=(64, 128))
    p.add_argument("--unshared-requests", type=int, default=128)
    p.add_argument("--unshared-input", type=int, nargs=2, default=(1000, 2000))
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=None)
    add_engine_args(p, skip=("num_pages", "max_rank", "max_queue", "prefix_caching"), defaults={
        "dtype": "float16", "device": "cuda" if torch.cuda.is_available() else "cpu",
        "max_num_seqs": 128, "max_num_batched_tokens": 4096, "max_model_len": 4096})
    args = p.parse_args(argv)
    if args.smoke:
        args.shape, args.device, args.dtype, args.arena_gb = "tiny", "cpu", "float32", 0.002
        args.conversations, args.turns, args.system_tokens, args.adapters = 4, 3, 40, 2
        args.rank, args.rate, args.think_s = 8, 1000.0, 0.0
        args.user_tokens, args.output_tokens = (4, 12), (2, 6)
        args.unshared_requests, args.unshared_input = 6, (20, 40)
        args.max_num_seqs, args.max_num_batched_tokens, args.max_model_len = 8, 64, 256
        args.cuda_graphs = False
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    record = run_record(["bench.prefix_cache", *(argv if argv is not None else sys.argv[1:])])
    cfg = model_config(args.shape)
    spec = ChatSpec(conversations=args.conversations, turns=args.turns,
                    system_tokens=args.system_tokens, adapters=args.adapters,
                    user_tokens=tuple(args.user_tokens), output_tokens=tuple(args.output_tokens),
                    rate=args.rate, think_s=args.think_s, seed=args.seed)
    result: dict[str, Any] = {**record, "args": vars(args), "workload": asdict(spec),
                              "shape": args.shape, "chat": {}, "unshared": {}}
    engines = Engines(args, cfg)
    for caching in (True, False):
        arm = "cache_on" if caching else "cache_off"
        # One engine an arm (a build captures every CUDA graph: most of a run's minutes).
        engine = engines.build(caching)
        # Untimed: a few conversations of another system prompt meet the shapes first (on the
        # CPU, the first arm in the process otherwise paid ~15x in first-use costs).
        warm_spec = replace(spec, conversations=min(2, spec.conversations),
                            turns=min(3, spec.turns), seed=spec.seed + 100)
        run_chat(engine, conversations(warm_spec, cfg.vocab_size), f"warm {arm}")
        engine.stats.reset()
        result["chat"][arm] = run_chat(engine, conversations(spec, cfg.vocab_size),
                                       f"chat {arm}")
        result["num_pages"] = engine.config.num_pages
        engine.stats.reset()  # the chat's cached pages stay: never hit, evicted as needed
        result["unshared"][arm] = run_unshared(engine, args, cfg.vocab_size, f"unshared {arm}")
        print(json.dumps({arm: {k: result["chat"][arm][k] for k in (
            "ttft_s", "output_tok_per_s", "hit_rate", "evictions")}}), file=sys.stderr)
        del engine  # else this name keeps the arm's arena alive while the next is built
    engines.release()
    chat, un = result["chat"], result["unshared"]
    result["ratios"] = ratios(chat["cache_on"], chat["cache_off"])
    result["ratios"]["unshared_throughput_on_over_off"] = (
        un["cache_on"]["output_tok_per_s"] / un["cache_off"]["output_tok_per_s"])
    r = result["ratios"]
    result["targets"] = {"ttft_p50_3x_lower": r["ttft_p50_off_over_on"] >= 3.0,
                         "throughput_1.5x_higher": r["output_throughput_on_over_off"] >= 1.5,
                         "unshared_loses_at_most_1pct": r["unshared_throughput_on_over_off"]
                         >= 0.99}
    print(json.dumps({"ratios": r, "targets": result["targets"]}, indent=1))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
