"""Structured output's cost in a mixed batch (issue 34): 64 streams over one random base model
with mixed-rank adapters, half the requests constrained by JSON schemas (the test corpus), half
free, side by side with the same requests all unconstrained, in one run.

    python -m bench.structured_output --shape llama2-7b --device cuda --dtype float16 \
        --streams 64 --requests 512 --out bench/results/structured-output-h200.json

The mixed arm runs first each repeat; its requests' output lengths are then given to the
all-unconstrained arm (ignore_eos, max_new_tokens = that length), so both arms generate the same
tokens and the throughput ratio is tokens/s mixed / tokens/s unconstrained. The model is random:
constrained outputs are valid JSON because of the grammar alone. The tokenizer is synthetic (a
byte-level BPE of the shape's vocabulary size built from seeded merges; the machine may have no
network), so grammar compile times are for a vocabulary of that size, not a real one.
`--shape tiny --device cpu` is the smoke mode the tests run.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
from tokenizers import Tokenizer as HFTokenizer
from tokenizers import decoders, models, pre_tokenizers

from bench.run_record import run_record
from bench.serving import ATTN, model_config
from devtools.synthetic import random_adapter, shared_weight_view
from slora_core.config import EngineConfig, parse_dtype
from slora_core.engine import LLMEngine
from slora_core.sampling_params import SamplingParams
from slora_core.structured.spec import StructuredOutput
from slora_core.tokenizer import Tokenizer
from slora_core.weights import build_random_model

CORPUS = Path(__file__).resolve().parent.parent / "tests" / "data" / "json_schemas.json"
BOS, EOS = "<s>", "</s>"
# Pieces the synthetic merges favour, so the vocabulary holds JSON-ish tokens as real ones do.
JSON_PIECES = ('{"', '":', '", "', '"}', ', "', '": "', '[', ']', 'true', 'false', 'null',
               'name', 'id', 'type', 'value')


def synthetic_tokenizer(vocab_size: int, seed: int = 0) -> Tokenizer:
    """A byte-level BPE tokenizer of exactly `vocab_size` ids: BOS, EOS, the 256 byte tokens,
    then tokens made by merging two earlier ones (seeded), JSON pieces first."""
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    byte_of = {c: bytes([b]) for b, c in zip(range(256), sorted(alphabet, key=_byte_rank))}
    vocab: dict[str, int] = {BOS: 0, EOS: 1}
    for c in sorted(alphabet, key=_byte_rank):
        vocab[c] = len(vocab)
    merges: list[tuple[str, str]] = []
    tokens = list(vocab)[2:]
    rng = random.Random(seed)
    printable = [t for t in tokens if byte_of[t].isalnum() or byte_of[t] in b' {}[]":,.-_']
    for piece in JSON_PIECES:
        _merge_text(piece, byte_of, vocab, merges, tokens)
    while len(vocab) < vocab_size:
        a = rng.choice(tokens[-200:] if rng.random() < 0.3 else printable)
        b = rng.choice(printable)
        if a + b not in vocab:
            merges.append((a, b))
            vocab[a + b] = len(vocab)
            tokens.append(a + b)
    bpe = models.BPE(vocab=vocab, merges=merges)
    backend = HFTokenizer(bpe)
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    backend.add_special_tokens([BOS, EOS])
    return Tokenizer(backend, 0, [1], add_bos_token=True)


def _byte_rank(c: str) -> int:
    inverse = {v: k for k, v in _bytes_to_unicode().items()}
    return inverse[c]


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> printable character table (what ByteLevel uses)."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(
        range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return dict(zip(bs, map(chr, cs)))


def _merge_text(text: str, byte_of: dict[str, bytes], vocab: dict[str, int],
                merges: list[tuple[str, str]], tokens: list[str]) -> None:
    table = _bytes_to_unicode()
    chars = [table[b] for b in text.encode()]
    token = chars[0]
    for c in chars[1:]:
        if token + c not in vocab:
            merges.append((token, c))
            vocab[token + c] = len(vocab)
            tokens.append(token + c)
        token += c


def build(args: argparse.Namespace) -> tuple[LLMEngine, Tokenizer]:
    cfg = model_config(args.shape)
    dtype = parse_dtype(args.dtype)
    tokenizer = synthetic_tokenizer(cfg.vocab_size)
    model = build_random_model(cfg, dtype, args.device, seed=0)
    page_bytes = (16 * cfg.num_hidden_layers * 2 * cfg.num_key_value_heads * cfg.head_dim
                  * torch.finfo(dtype).bits // 8)
    config = EngineConfig(device=args.device, dtype=args.dtype, max_model_len=args.max_model_len,
                          num_pages=max(64, int(args.arena_gb * 2**30 // page_bytes)),
                          max_num_seqs=args.streams, max_rank=max(args.ranks),
                          max_queue=100_000)
    engine = LLMEngine(model, cfg, tokenizer, config, detokenize=False)
    for i in range(args.adapters):
        rank = args.ranks[i % len(args.ranks)]
        base = random_adapter(cfg, rank, modules=ATTN, dtype=dtype, seed=rank,
                              pin_memory=args.device.startswith("cuda"))
        engine.add_adapter(f"a{i}", shared_weight_view(base, i))
    engine.warmup()
    return engine, tokenizer


def workload(args: argparse.Namespace, vocab: int) -> list[dict[str, Any]]:
    """Requests: prompt ids, adapter (None = base for a share), a schema for every other one."""
    rng = np.random.default_rng(args.seed)
    schemas = list(json.loads(CORPUS.read_text()).items())
    out = []
    for i in range(args.requests):
        adapter = None if args.adapters == 0 or i % (args.adapters + 1) == 0 else (
            f"a{i % args.adapters}")
        name, schema = schemas[i // 2 % len(schemas)]
        out.append({"id": f"r{i}", "prompt": rng.integers(3, vocab,
                                                         args.prompt_tokens).tolist(),
                    "prompt_tokens": args.prompt_tokens, "vocab": vocab, "adapter": adapter, "schema_name": name if i % 2 == 0 else None,
                    "schema": schema if i % 2 == 0 else None})
    return out


def fresh_prompts(reqs: list[dict[str, Any]], seed: int) -> list[dict[str, Any]]:
    """`reqs` with new random prompts of the same lengths: no arm reuses another's prefix
    cache, so neither is handed the other's prefills."""
    rng = np.random.default_rng(10_000 + seed)
    return [{**r, "prompt": rng.integers(3, r["vocab"], r["prompt_tokens"]).tolist()}
            for r in reqs]


def run_arm(engine: LLMEngine, reqs: list[dict[str, Any]], streams: int, max_tokens: int,
            lengths: dict[str, int] | None, tag: str) -> dict[str, Any]:
    """Keep `streams` requests in flight until all are done. `lengths` given: every request
    unconstrained with exactly that many tokens (ignore_eos)."""
    pending = list(reqs)
    out_tokens: dict[str, list[int]] = {r["id"]: [] for r in reqs}
    live = 0
    start = time.perf_counter()
    while pending or engine.has_unfinished():
        while pending and live < streams:
            r = pending.pop(0)
            rid = f"{tag}-{r['id']}"
            if lengths is not None:
                params = SamplingParams(temperature=1.0, seed=int(r["id"][1:]),
                                        max_new_tokens=max(1, lengths[r["id"]]), ignore_eos=True)
                engine.add_request(rid, r["prompt"], params, adapter=r["adapter"])
            else:
                constrained = r["schema"] is not None
                params = SamplingParams(temperature=1.0, seed=int(r["id"][1:]),
                                        max_new_tokens=max_tokens, ignore_eos=not constrained)
                engine.add_request(rid, r["prompt"], params, adapter=r["adapter"],
                                   structured=StructuredOutput.json_schema(r["schema"])
                                   if constrained else None)
            live += 1
        for o in engine.step():
            out_tokens[o.request_id.split("-", 1)[1]] += o.token_ids
            if o.finished:
                live -= 1
                if o.error:
                    raise RuntimeError(f"{o.request_id}: {o.error}")
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    seconds = time.perf_counter() - start
    tokens = sum(len(t) for t in out_tokens.values())
    return {"seconds": seconds, "tokens": tokens, "tokens_per_s": tokens / seconds,
            "outputs": out_tokens}


def check_outputs(reqs: list[dict[str, Any]], outputs: dict[str, list[int]],
                  tokenizer: Tokenizer, eos: int) -> dict[str, int]:
    import jsonschema

    valid = invalid = 0
    for r in reqs:
        if r["schema"] is None:
            continue
        ids = [t for t in outputs[r["id"]] if t != eos]
        try:
            jsonschema.validate(json.loads(tokenizer.decode(ids)), r["schema"])
            valid += 1
        except (json.JSONDecodeError, jsonschema.ValidationError):
            invalid += 1
    return {"valid": valid, "invalid": invalid}


def percentile(values: list[float], q: float) -> float | None:
    return float(np.percentile(values, q)) if values else None


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shape", default="llama2-7b")
    p.add_argument("--device", default="cuda")
    p.add_argument("--dtype", default="float16")
    p.add_argument("--streams", type=int, default=64)
    p.add_argument("--requests", type=int, default=512)
    p.add_argument("--prompt-tokens", type=int, default=128)
    p.add_argument("--max-tokens", type=int, default=256)
    p.add_argument("--max-model-len", type=int, default=1024)
    p.add_argument("--adapters", type=int, default=8)
    p.add_argument("--ranks", type=int, nargs="+", default=[8, 16, 32, 64])
    p.add_argument("--arena-gb", type=float, default=40.0)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    record = run_record(["bench.structured_output", *(argv if argv is not None else sys.argv[1:])])
    engine, tokenizer = build(args)
    reqs = workload(args, engine.model_config.vocab_size)
    eos = engine.eos_token_ids[0]
    # Every schema compiled once before timing (the cache serves them afterwards, as in a
    # server whose clients reuse their schemas); cold compiles are what grammar_compile_ms is.
    warm = reqs[: 2 * len(json.loads(CORPUS.read_text()))]
    run_arm(engine, warm, args.streams, args.max_tokens, None, "warm")
    assert engine.loop.grammars is not None  # the engine has a tokenizer
    # Waits are reported for the timed arms (the warm-up built the backend and compiled).
    engine.loop.grammars.wait_s.clear()
    arms: list[dict[str, Any]] = []
    for rep in range(args.repeats):
        mixed = run_arm(engine, fresh_prompts(reqs, 2 * rep), args.streams, args.max_tokens,
                        None, f"m{rep}")
        lengths = {k: len(v) for k, v in mixed["outputs"].items()}
        free = run_arm(engine, fresh_prompts(reqs, 2 * rep + 1), args.streams, args.max_tokens,
                       lengths, f"f{rep}")
        checked = check_outputs(reqs, mixed["outputs"], tokenizer, eos)
        arms.append({"repeat": rep, "mixed_tokens_per_s": mixed["tokens_per_s"],
                     "unconstrained_tokens_per_s": free["tokens_per_s"],
                     "ratio": mixed["tokens_per_s"] / free["tokens_per_s"],
                     "tokens": mixed["tokens"], "same_tokens": mixed["tokens"] == free["tokens"],
                     "constrained_outputs": checked})
        print(f"repeat {rep}: mixed {mixed['tokens_per_s']:.0f} tok/s, unconstrained "
              f"{free['tokens_per_s']:.0f} tok/s, ratio {arms[-1]['ratio']:.3f}, "
              f"constrained outputs {checked}", flush=True)
    grammars = engine.loop.grammars
    assert grammars is not None  # the engine has a tokenizer
    compile_ms = [s * 1e3 for s in grammars.compiler.stats.compile_s]
    wait_ms = [s * 1e3 for s in grammars.wait_s]
    ratios = [a["ratio"] for a in arms]
    result = {**record, "shape": args.shape, "args": vars(args), "arms": arms,
              "ratio_median": float(np.median(ratios)),
              "throughput_cost": 1.0 - float(np.median(ratios)),
              "grammar_compile_ms": {"n": len(compile_ms), "p50": percentile(compile_ms, 50),
                                     "p99": percentile(compile_ms, 99)},
              "grammar_wait_ms": {"n": len(wait_ms), "p50": percentile(wait_ms, 50),
                                  "p99": percentile(wait_ms, 99)},
              "cache": {"hits": grammars.compiler.stats.hits,
                        "misses": grammars.compiler.stats.misses}}
    print(f"median ratio {result['ratio_median']:.3f} (cost {result['throughput_cost']:.1%}); "
          f"compile p50 {result['grammar_compile_ms']['p50']} ms, "
          f"p99 {result['grammar_compile_ms']['p99']} ms")
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1))
    engine.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
