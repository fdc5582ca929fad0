"""Constrained decoding pieces on the demo tokenizer: specs, compiles (xgrammar, the llguidance
fallback), the cache, the time limit, the batched mask in the sampler."""

from __future__ import annotations

import codecs
import json
import time
from pathlib import Path

import jsonschema
import pytest
import torch

from slora_core.sampler import Sampler
from slora_core.sampling_params import SamplingParams
from slora_core.structured.backend import GrammarBackend
from slora_core.structured.bitmask import GrammarMask, allowed_tokens, apply_grammar_mask
from slora_core.structured.compiler import CompileLimits, GrammarCompiler
from slora_core.structured.requests import GrammarRequests
from slora_core.structured.spec import MAX_SPEC_BYTES, StructuredOutput, StructuredOutputError
from slora_core.tokenizer import Tokenizer

VOCAB = 512
EOS = 1
SCHEMA = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 8},
    "age": {"type": "integer", "minimum": 0, "maximum": 120},
    "tags": {"type": "array", "items": {"enum": ["a", "b"]}, "maxItems": 3}},
    "required": ["name", "age"]}


@pytest.fixture(scope="module")
def tokenizer(demo_dir: Path) -> Tokenizer:
    return Tokenizer.from_dir(demo_dir / "model")


@pytest.fixture(scope="module")
def backend(tokenizer: Tokenizer) -> GrammarBackend:
    return GrammarBackend(tokenizer.backend, VOCAB, tuple(tokenizer.eos_token_ids))


def _walk(grammars: GrammarRequests, rids: list[str], steps: int = 200,
          seed: int = 0) -> dict[str, list[int]]:
    """Random logits through the sampler with the grammars' masks until every request's
    grammar terminates: what a random model does under constraints."""
    sampler = Sampler(seed=seed)
    gen = torch.Generator().manual_seed(seed)
    out: dict[str, list[int]] = {r: [] for r in rids}
    live = list(rids)
    for _ in range(steps):
        if not live:
            break
        logits = torch.randn(len(live), VOCAB, generator=gen) * 3
        params = [SamplingParams(temperature=1.0)] * len(live)
        toks = sampler.sample(logits, params, [None] * len(live), [()] * len(live),
                              [0] * len(live), [1], grammar=grammars.mask(live))
        for rid, tok in zip(list(live), toks, strict=True):
            assert grammars.accept(rid, tok.token_id), (rid, tok.token_id)
            if tok.token_id != EOS:
                out[rid].append(tok.token_id)
            if grammars.is_terminated(rid):
                live.remove(rid)
                continue
            if not grammars.is_constrained(rid) and len(out[rid]) == 5:
                live.remove(rid)  # a free row: a few tokens to share the batch
    assert not live, f"{live} did not finish in {steps} steps"
    return out


def _ready(grammars: GrammarRequests) -> tuple[list[str], list[tuple[str, str]]]:
    ready, failed = [], []
    deadline = time.monotonic() + 30
    while grammars.has_pending and time.monotonic() < deadline:
        grammars.wait(0.1)
        r, f = grammars.poll()
        ready += r
        failed += f
    return ready, failed


def test_spec_validation() -> None:
    with pytest.raises(StructuredOutputError, match="unknown structured output kind"):
        StructuredOutput("yaml", "x")
    with pytest.raises(StructuredOutputError, match="not valid JSON"):
        StructuredOutput("json_schema", "{nope")
    with pytest.raises(StructuredOutputError, match="must be a JSON object"):
        StructuredOutput.json_schema("[1, 2]")
    with pytest.raises(StructuredOutputError, match="past the limit"):
        StructuredOutput.json_schema({"description": "x" * MAX_SPEC_BYTES})
    with pytest.raises(StructuredOutputError, match="non-empty list of strings"):
        StructuredOutput.choice([])
    with pytest.raises(StructuredOutputError, match="regex must not be empty"):
        StructuredOutput("regex", "")
    a, b = StructuredOutput.json_schema(SCHEMA), StructuredOutput.json_schema(json.dumps(SCHEMA))
    assert a == b and a.digest == b.digest
    assert a.digest != StructuredOutput("regex", "a").digest


def test_mixed_batch_outputs_follow_their_grammars(backend: GrammarBackend,
                                                   tokenizer: Tokenizer) -> None:
    grammars = GrammarRequests(backend, VOCAB)
    grammars.submit("schema", StructuredOutput.json_schema(SCHEMA))
    grammars.submit("regex", StructuredOutput("regex", r"[a-c]{2}-\d{3}"))
    grammars.submit("choice", StructuredOutput.choice(["red", "green", "blue"]))
    grammars.submit("ebnf", StructuredOutput("grammar", 'root ::= "<" [0-9] [0-9]? ">"'))
    grammars.submit("object", StructuredOutput("json_object"))
    ready, failed = _ready(grammars)
    assert not failed and len(ready) == 5
    out = _walk(grammars, ["schema", "free", "regex", "choice", "ebnf"])
    text = {r: tokenizer.decode(ids) for r, ids in out.items()}
    jsonschema.validate(json.loads(text["schema"]), SCHEMA)
    assert __import__("re").fullmatch(r"[a-c]{2}-\d{3}", text["regex"]), text["regex"]
    assert text["choice"] in ("red", "green", "blue")
    assert __import__("re").fullmatch(r"<\d\d?>", text["ebnf"]), text["ebnf"]
    assert out["free"] and not grammars.is_constrained("free")


def test_mask_touches_only_constrained_rows(backend: GrammarBackend) -> None:
    grammars = GrammarRequests(backend, VOCAB)
    grammars.submit("c", StructuredOutput.choice(["yes", "no"]))
    _ready(grammars)
    mask = grammars.mask(["free", "c", "free2"])
    assert mask is not None and mask.rows == (1,)
    logits = torch.randn(3, VOCAB)
    scores = apply_grammar_mask(logits, mask)
    assert torch.equal(scores[0], logits[0]) and torch.equal(scores[2], logits[2])
    allowed = allowed_tokens(mask.bitmask, VOCAB)[0]
    assert torch.isinf(scores[1][~allowed]).all() and torch.equal(scores[1][allowed],
                                                                   logits[1][allowed])
    assert 0 < int(allowed.sum()) < VOCAB
    assert not allowed[0], "BOS (a special token, no text) is never allowed under a grammar"
    assert grammars.mask(["free"]) is None


def test_bitmask_unpacking_matches_bits() -> None:
    bits = torch.tensor([[-2**31, 5]], dtype=torch.int32)  # tokens 31, 32 and 34
    allowed = allowed_tokens(bits, 70)
    assert allowed.nonzero()[:, 1].tolist() == [31, 32, 34]
    assert allowed.shape == (1, 70)
    with pytest.raises(ValueError, match="for 2 rows"):
        GrammarMask(torch.zeros(1, 2, dtype=torch.int32), (0, 1))


@pytest.mark.parametrize(("spec", "problem"), [
    (StructuredOutput("json_schema", '{"type": "objec"}'), 'Unsupported type "objec"'),
    (StructuredOutput("regex", "(abc"), "regex"),
    (StructuredOutput("grammar", "root ::= missing"), 'Rule "missing" is not defined'),
])
def test_refusals_name_the_problem_and_are_cached(backend: GrammarBackend,
                                                 spec: StructuredOutput, problem: str) -> None:
    compiler = GrammarCompiler(backend)
    with pytest.raises(StructuredOutputError, match=problem):
        compiler.compile_now(spec)
    start = time.perf_counter()
    with pytest.raises(StructuredOutputError, match=problem):
        compiler.compile_now(spec)
    assert time.perf_counter() - start < 0.05
    assert compiler.stats.errors == 1 and compiler.stats.hits == 1


def test_cache_hit_and_llguidance_fallback(backend: GrammarBackend, tokenizer: Tokenizer) -> None:
    compiler = GrammarCompiler(backend)
    first = compiler.compile_now(StructuredOutput.json_schema(SCHEMA))
    again = compiler.compile_now(StructuredOutput.json_schema(json.dumps(SCHEMA)))
    assert first is again and compiler.stats.hits == 1 and first.backend == "xgrammar"
    # A Lark grammar: xgrammar's EBNF parser refuses it, llguidance compiles it.
    lark = StructuredOutput("grammar", 'start: "ab" NUM\nNUM: /[0-9]{2}/')
    grammar = compiler.compile_now(lark)
    assert grammar.backend == "llguidance"
    grammars = GrammarRequests(backend, VOCAB)
    grammars.submit("lark", lark)
    _ready(grammars)
    text = tokenizer.decode(_walk(grammars, ["lark"])["lark"])
    assert __import__("re").fullmatch(r"ab[0-9]{2}", text), text


def test_slow_compile_times_out_and_others_go_on(backend: GrammarBackend) -> None:
    # ~0.1 s to compile on this vocabulary; the limit is far below it.
    slow = StructuredOutput("grammar", "root ::= " + " | ".join(
        f'"w{i}" root' for i in range(4000)) + ' | "x"')
    grammars = GrammarRequests(backend, VOCAB, CompileLimits(timeout_s=0.005, threads=1))
    grammars.submit("slow", slow)
    time.sleep(0.01)
    ready, failed = grammars.poll()
    assert ready == [] and failed == [("slow", "grammar did not compile within 0.005 s")]
    assert grammars.compiler.stats.timeouts == 1
    assert not grammars.has_pending


def test_bad_limits() -> None:
    with pytest.raises(ValueError, match="timeout_s"):
        CompileLimits(timeout_s=0)


CORPUS = json.loads((Path(__file__).resolve().parents[1] / "data" / "json_schemas.json"
                     ).read_text())


def _corpus_walk(backend: GrammarBackend, tokenizer: Tokenizer, names: list[str],
                 seed: int) -> None:
    grammars = GrammarRequests(backend, VOCAB)
    for name in names:
        grammars.submit(name, StructuredOutput.json_schema(CORPUS[name]))
    ready, failed = _ready(grammars)
    assert not failed and sorted(ready) == sorted(names)
    out = _walk(grammars, names, steps=400, seed=seed)
    for name in names:
        text = tokenizer.decode(out[name])
        jsonschema.validate(json.loads(text), CORPUS[name])


def test_corpus_is_large_and_varied() -> None:
    text = json.dumps(CORPUS)
    assert len(CORPUS) >= 50
    for keyword in ('"$ref"', '"enum"', '"anyOf"', '"maximum"', '"items"', '"allOf"'):
        assert keyword in text, keyword
    assert any(set(s.get("properties", {})) - set(s.get("required", ()))
               for s in CORPUS.values() if isinstance(s, dict)), "no optional fields"


def test_corpus_slice_random_walks_validate(backend: GrammarBackend,
                                            tokenizer: Tokenizer) -> None:
    _corpus_walk(backend, tokenizer, list(CORPUS)[::7], seed=0)


@pytest.mark.slow
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_whole_corpus_random_walks_validate(backend: GrammarBackend, tokenizer: Tokenizer,
                                            seed: int) -> None:
    """Random logits (any model) under each schema's grammar: every output parses and
    validates; allOf goes to llguidance, which enforces it (xgrammar reads it as "any")."""
    _corpus_walk(backend, tokenizer, list(CORPUS), seed)


def test_no_surrogate_after_an_ed_lead_byte(backend: GrammarBackend, tokenizer: Tokenizer) -> None:
    """xgrammar lets a string continue ED with A0-BF (a UTF-16 surrogate, three U+FFFD once
    decoded); the guard clears those tokens, and keeps ED 80-9F (U+D000-U+D7FF)."""
    from bench.structured_output import _bytes_to_unicode

    char = _bytes_to_unicode()
    ids = {b: t for b in (0xED, 0x80, 0x9F, 0xA0, 0xAE, 0xBF)
           if (t := tokenizer.token_to_id(char[b])) is not None}
    grammars = GrammarRequests(backend, VOCAB)
    grammars.submit("s", StructuredOutput.json_schema({"type": "string", "maxLength": 10}))
    _ready(grammars)
    for token in tokenizer.encode('"', add_special_tokens=False) + [ids[0xED]]:
        assert grammars.accept("s", token)
    mask = grammars.mask(["s"])
    assert mask is not None
    allowed = allowed_tokens(mask.bitmask, VOCAB)[0]
    assert allowed[ids[0x80]] and allowed[ids[0x9F]]
    assert not any(allowed[ids[b]] for b in (0xA0, 0xAE, 0xBF))


def test_max_length_string_bytes_stay_utf8_within_the_limit(backend: GrammarBackend,
                                                             tokenizer: Tokenizer) -> None:
    """Every byte the masks allow inside a maxLength string keeps it valid UTF-8, and one
    character fills a maxLength 1 string. xgrammar 0.2.9 alone lets ED continue with A0-BF (a
    surrogate: three U+FFFD once decoded): without the guard the whole-corpus engine test fails
    on maxLength (invoice_optional, seed 1). Walks every lead byte, then the edges of each
    continuation range the mask allows."""
    from bench.structured_output import _bytes_to_unicode

    byte_token = {b: t for b, c in _bytes_to_unicode().items()
                  if (t := tokenizer.token_to_id(c)) is not None}
    assert len(byte_token) == 256
    grammar = backend.compile(StructuredOutput.json_schema({"type": "string", "maxLength": 1}))
    row = torch.empty(1, backend.bitmask_width, dtype=torch.int32)

    def allowed(body: bytes) -> list[int]:
        matcher = grammar.matcher()
        for b in b'"' + body:
            assert matcher.accept(byte_token[b]), body
        matcher.fill(row, 0)
        ok = allowed_tokens(row, VOCAB)[0]
        return sorted(b for b, t in byte_token.items() if ok[t])

    paths, walked = [b""], 0
    while paths:
        body = paths.pop()
        walked += 1
        nxt = allowed(body)
        for b in nxt:  # raises on a byte that makes the text invalid UTF-8
            codecs.getincrementaldecoder("utf-8")().decode(body + bytes([b]), final=False)
        if body and codecs.getincrementaldecoder("utf-8")().decode(body, final=False):
            assert nxt == [ord('"')] and len(body.decode()) == 1, body
            continue
        cont = [b for b in nxt if 0x80 <= b <= 0xBF]
        paths += [body + bytes([b]) for b in {*cont[:1], *cont[-1:]}]
        if not body:
            paths += [bytes([b]) for b in nxt if b >= 0xC0]
    assert walked > 200


def test_batched_fill_equals_one_row_at_a_time(backend: GrammarBackend) -> None:
    names = list(CORPUS)[:6]
    batched, single = GrammarRequests(backend, VOCAB), GrammarRequests(backend, VOCAB)
    for grammars in (batched, single):
        for name in names:
            grammars.submit(name, StructuredOutput.json_schema(CORPUS[name]))
        _ready(grammars)
    ids = ["free", *names]
    mask = batched.mask(ids)
    assert mask is not None and mask.rows == tuple(range(1, len(ids)))
    for j, name in enumerate(names):
        row = torch.empty(1, mask.bitmask.shape[1], dtype=torch.int32)
        single._matchers[name].fill(row, 0)
        assert torch.equal(mask.bitmask[j], row[0]), name
