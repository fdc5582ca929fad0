"""Grammar backends: xgrammar first, llguidance for what xgrammar refuses.

A `GrammarBackend` belongs to one tokenizer (and the model's vocabulary size). `compile` turns a
`StructuredOutput` into a `Grammar`; `Grammar.matcher()` gives one request its own `Matcher`,
which advances with the tokens the request accepts and fills that request's row of a token
bitmask (int32 words, bit t of word t // 32 set = token t allowed; the layout both backends
share).
"""

from __future__ import annotations

import hashlib
import json
import re
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from slora_core.structured.spec import StructuredOutput, StructuredOutputError

# xgrammar prefixes its errors with a time stamp and a C++ source position.
_CPP_PREFIX = re.compile(r"^\[[\d:]+\] \S+:\d+: ")
JSON_KINDS = ("json_schema", "json_object")
# Schema keywords xgrammar 0.2.9 accepts but does not enforce (its output may break them, e.g.
# allOf is read as "anything"): schemas using them go to llguidance, which enforces them.
XGRAMMAR_IGNORES = frozenset({"allOf", "not", "if", "then", "else", "dependentRequired",
                              "dependentSchemas", "uniqueItems", "contains"})


class Matcher(Protocol):
    """One request's position in its grammar."""

    def accept(self, token_id: int) -> bool:
        """Advance by a sampled token; False if the grammar does not allow it."""

    def fill(self, bitmask: torch.Tensor, row: int) -> None:
        """Write the tokens allowed next into row `row` of an int32 [B, ceil(V / 32)] mask."""

    def is_terminated(self) -> bool:
        """Nothing may follow: a stop token was accepted, or (llguidance) the last token
        completed a grammar that allows no continuation."""


@dataclass(frozen=True)
class Grammar:
    """A compiled grammar, shareable between requests (each takes its own matcher)."""

    backend: str  # "xgrammar" or "llguidance"
    compiled: Any
    size_bytes: int
    _owner: GrammarBackend
    is_json: bool = False

    def matcher(self) -> Matcher:
        return self._owner.matcher(self)


def _clean(error: BaseException) -> str:
    lines = [_CPP_PREFIX.sub("", line) for line in str(error).strip().splitlines()]
    return " ".join(line.strip() for line in lines if line.strip())


def _hf_tokenizer(backend: Any) -> Any:
    """A transformers wrapper around a `tokenizers.Tokenizer`, with its special tokens named
    (both grammar libraries read the vocabulary through transformers)."""
    import transformers  # a dependency of xgrammar; imported only when grammars are used

    specials = [t.content for t in backend.get_added_tokens_decoder().values() if t.special]
    return transformers.PreTrainedTokenizerFast(tokenizer_object=backend,
                                                additional_special_tokens=specials)


def tokenizer_identity(backend: Any, vocab_size: int, stop_token_ids: tuple[int, ...]) -> str:
    """A digest of everything a compiled grammar depends on besides the grammar itself."""
    h = hashlib.sha256(backend.to_str().encode())
    h.update(json.dumps([vocab_size, list(stop_token_ids)]).encode())
    return h.hexdigest()


class GrammarBackend:
    """Compiles grammars for one tokenizer and vocabulary (`vocab_size`: the model's logits
    width, which may pass the tokenizer's; ids past the tokenizer's are never allowed).

    `special_token_ids` that are not stop tokens (BOS, padding) are never allowed under a
    grammar: they decode to no text, so the grammar must not count them as characters."""

    def __init__(self, tokenizer_backend: Any, vocab_size: int,
                 stop_token_ids: tuple[int, ...]) -> None:
        import xgrammar as xgr

        self.vocab_size = vocab_size
        self.stop_token_ids = tuple(stop_token_ids)
        self.identity = tokenizer_identity(tokenizer_backend, vocab_size, self.stop_token_ids)
        self._hf = _hf_tokenizer(tokenizer_backend)
        info = xgr.TokenizerInfo.from_huggingface(self._hf, vocab_size=vocab_size,
                                                  stop_token_ids=list(self.stop_token_ids))
        # One thread per compile: the compile pool (compiler.py) runs compiles side by side.
        self._xgr = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)
        self._llg_tokenizer: Any = None
        banned = set(self._hf.all_special_ids) - set(self.stop_token_ids)
        # Compact JSON holds no raw control character (strings escape them), but xgrammar's
        # length-bounded strings allow them (0.2.9): tokens with such bytes are banned under
        # JSON grammars, so every output parses.
        control = {i for i, b in enumerate(info.decoded_vocab)
                   if i not in self.stop_token_ids and any(c < 0x20 for c in b)}
        self._keep = keep_mask(vocab_size, banned)
        self._keep_json = keep_mask(vocab_size, banned | control)
        self.utf8 = Utf8Guard(info.decoded_vocab, vocab_size)

    @property
    def bitmask_width(self) -> int:
        return (self.vocab_size + 31) // 32

    def compile(self, spec: StructuredOutput) -> Grammar:
        """Compile with xgrammar; if it refuses, with llguidance. Raises StructuredOutputError
        naming the problem when both refuse (the message is xgrammar's)."""
        if spec.kind == "json_schema" and _uses(spec.schema(), XGRAMMAR_IGNORES):
            try:
                grammar = self._compile_llguidance(spec)
            except (RuntimeError, ValueError) as e:
                raise StructuredOutputError(f"json_schema refused: {_clean(e)}") from None
            return Grammar("llguidance", grammar, len(grammar), self, True)
        try:
            compiled = self._compile_xgrammar(spec)
            return Grammar("xgrammar", compiled, int(compiled.memory_size_bytes), self,
                           spec.kind in JSON_KINDS)
        except RuntimeError as e:
            first = _clean(e)
        try:
            grammar = self._compile_llguidance(spec)
        except (RuntimeError, ValueError):
            raise StructuredOutputError(f"{spec.kind} refused: {first}") from None
        return Grammar("llguidance", grammar, len(grammar), self, spec.kind in JSON_KINDS)

    def _compile_xgrammar(self, spec: StructuredOutput) -> Any:
        c = self._xgr
        if spec.kind == "json_schema":
            # Whitespace as json.dumps writes it, never free: a model can otherwise emit
            # newlines forever inside a valid document and never finish.
            return c.compile_json_schema(spec.value, any_whitespace=False, strict_mode=True)
        if spec.kind == "json_object":
            return c.compile_json_schema('{"type": "object"}', any_whitespace=False)
        if spec.kind == "regex":
            return c.compile_regex(spec.value)
        if spec.kind == "choice":
            return c.compile_grammar(choice_ebnf(spec.choices()))
        return c.compile_grammar(spec.value)

    def _compile_llguidance(self, spec: StructuredOutput) -> str:
        import llguidance

        if spec.kind == "json_schema":
            schema = _closed(spec.schema())
            if isinstance(schema, dict):
                schema = {**schema, "x-guidance": {"whitespace_flexible": False}}
            grammar = llguidance.grammar_from("json_schema", json.dumps(schema))
        elif spec.kind == "json_object":
            grammar = llguidance.grammar_from("json_schema", '{"type": "object"}')
        elif spec.kind == "choice":
            grammar = llguidance.grammar_from("choice", spec.value)
        elif spec.kind == "regex":
            grammar = llguidance.grammar_from("regex", spec.value)
        else:
            grammar = llguidance.grammar_from("grammar", spec.value)
        error = llguidance.LLMatcher.validate_grammar(grammar, self._llguidance_tokenizer())
        if error:
            raise ValueError(error)
        return str(grammar)

    def _llguidance_tokenizer(self) -> Any:
        if self._llg_tokenizer is None:
            import llguidance.hf

            self._llg_tokenizer = llguidance.hf.from_tokenizer(
                self._hf, n_vocab=self.vocab_size, eos_token=list(self.stop_token_ids))
        return self._llg_tokenizer

    def matcher(self, grammar: Grammar) -> Matcher:
        keep = self._keep_json if grammar.is_json else self._keep
        if grammar.backend == "xgrammar":
            return XgrammarMatcher(grammar.compiled, keep, self.utf8)
        import llguidance

        return _LlguidanceMatcher(llguidance.LLMatcher(self._llguidance_tokenizer(),
                                                       grammar.compiled), keep, self.utf8)


def _closed(schema: Any) -> Any:
    """`schema` with `additionalProperties: false` on every object schema that does not say
    otherwise: what xgrammar's strict mode does, so both backends write the same objects."""
    if isinstance(schema, list):
        return [_closed(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out: dict[str, Any] = {}
    for key, value in schema.items():
        if key in ("properties", "patternProperties", "$defs", "definitions") and isinstance(
                value, dict):
            out[key] = {k: _closed(v) for k, v in value.items()}
        elif key in ("enum", "const", "required", "examples", "default", "allOf"):
            # allOf branches stay open: closed, each would forbid the others' properties.
            out[key] = value
        else:
            out[key] = _closed(value)
    if "properties" in out and "additionalProperties" not in out:
        out["additionalProperties"] = False
    return out


def _uses(schema: Any, keywords: frozenset[str]) -> bool:
    """Whether any (sub)schema of `schema` uses one of `keywords` (property names excluded)."""
    if isinstance(schema, list):
        return any(_uses(s, keywords) for s in schema)
    if not isinstance(schema, dict):
        return False
    for key, value in schema.items():
        if key in keywords:
            return True
        if key in ("properties", "patternProperties", "$defs", "definitions"):
            if isinstance(value, dict) and any(_uses(v, keywords) for v in value.values()):
                return True
        elif key not in ("enum", "const", "required", "examples", "default") and _uses(
                value, keywords):
            return True
    return False


def choice_ebnf(choices: list[str]) -> str:
    """An EBNF grammar matching exactly one of `choices` (JSON string escapes are EBNF's)."""
    return "root ::= " + " | ".join(json.dumps(c, ensure_ascii=False) for c in choices)


def keep_mask(vocab_size: int, banned: set[int]) -> torch.Tensor:
    """An int32 [ceil(vocab_size / 32)] bitmask of every token but the banned ones."""
    words = [0xFFFFFFFF] * ((vocab_size + 31) // 32)
    for t in banned:
        words[t // 32] &= ~(1 << (t % 32))
    # int32 words: the same 32 bits as signed values.
    return torch.tensor([w - (1 << 32) if w >= 1 << 31 else w for w in words],
                        dtype=torch.int32)


# UTF-8 lead bytes whose next byte has a narrower range than 0x80-0xBF (RFC 3629): E0 and F0
# (no overlong forms), ED (no surrogates), F4 (nothing past U+10FFFF).
NEXT_BYTE = {0xE0: (0xA0, 0xBF), 0xED: (0x80, 0x9F), 0xF0: (0x90, 0xBF), 0xF4: (0x80, 0x8F)}


class Utf8Guard:
    """Keeps grammar outputs valid UTF-8 across tokens. xgrammar 0.2.9 lets a string continue
    a lone ED lead byte with A0-BF (a surrogate: three U+FFFD once decoded, so a maxLength
    string came out longer than its limit); after a token ending in one of NEXT_BYTE's leads,
    tokens starting with a continuation byte outside that lead's range are cleared."""

    def __init__(self, decoded_vocab: list[bytes], vocab_size: int) -> None:
        self.last_byte = [b[-1] if b else -1 for b in decoded_vocab]
        self.after: dict[int, torch.Tensor] = {}
        for lead, (low, high) in NEXT_BYTE.items():
            bad = {i for i, b in enumerate(decoded_vocab)
                   if b and 0x80 <= b[0] <= 0xBF and not low <= b[0] <= high}
            self.after[lead] = keep_mask(vocab_size, bad)

    def lead_after(self, token_id: int) -> int | None:
        """The restricting lead byte a token leaves open at the end of the output, if any."""
        last = self.last_byte[token_id] if token_id < len(self.last_byte) else -1
        return last if last in NEXT_BYTE else None


class XgrammarMatcher:
    """`raw`: the xgrammar matcher, which GrammarRequests fills in batches (its threads);
    `finish_row` then applies what this module adds to the mask."""

    def __init__(self, compiled: Any, keep: torch.Tensor, utf8: Utf8Guard) -> None:
        import xgrammar as xgr

        self._m = self.raw = xgr.GrammarMatcher(compiled)
        self._keep = keep
        self._utf8 = utf8
        self._lead: int | None = None

    def accept(self, token_id: int) -> bool:
        self._lead = self._utf8.lead_after(token_id)
        return bool(self._m.accept_token(token_id))

    def fill(self, bitmask: torch.Tensor, row: int) -> None:
        self._m.fill_next_token_bitmask(bitmask, row)
        self.finish_row(bitmask, row)

    def finish_row(self, bitmask: torch.Tensor, row: int) -> None:
        bitmask[row] &= self._keep
        if self._lead is not None:
            bitmask[row] &= self._utf8.after[self._lead]

    def is_terminated(self) -> bool:
        return bool(self._m.is_terminated())


class _LlguidanceMatcher:
    def __init__(self, matcher: Any, keep: torch.Tensor, utf8: Utf8Guard) -> None:
        self._m = matcher
        self._keep = keep
        self._utf8 = utf8
        self._lead: int | None = None

    def accept(self, token_id: int) -> bool:
        self._lead = self._utf8.lead_after(token_id)
        return bool(self._m.consume_token(token_id))

    def fill(self, bitmask: torch.Tensor, row: int) -> None:
        import llguidance.torch

        llguidance.torch.fill_next_token_bitmask(self._m, bitmask, row)
        bitmask[row] &= self._keep
        if self._lead is not None:
            bitmask[row] &= self._utf8.after[self._lead]

    def is_terminated(self) -> bool:
        return bool(self._m.is_stopped())
