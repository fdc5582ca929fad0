"""TextStream (incremental detokenization, stop strings) and Tokenizer, on a byte-level BPE
tokenizer trained here with `tokenizers` on text with multi-byte characters."""

from __future__ import annotations

import json
import random
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from tokenizers import Tokenizer as HFTokenizer
from tokenizers import decoders, models, normalizers, pre_tokenizers, processors, trainers
from tokenizers.decoders import DecodeStream

import slora_core.tokenizer as tokenizer_module
from slora_core.detokenizer import REPLACEMENT_CHAR, TextStream
from slora_core.tokenizer import Tokenizer, TokenizerError

CORPUS = [
    "Hello world, the weather is nice today. Hello again!",
    "你好，世界！今天天气很好。我们一起去公园散步吧。",
    "Emoji time 😀🎉👍🏽 and flags 🇫🇷🇯🇵 with family 👨‍👩‍👧",
    "Café naïve résumé — “quotes” and ∑ maths ≤ 3",
    "日本語のテキストと한국어 텍스트도 있습니다。",
] * 20

SAMPLES = [
    "Hello 世界! 😀 ok",
    "今天天气很好😀🎉，我们去公园",
    "naïve café 👍🏽 ∑≤ 한국어",
    "👨‍👩‍👧🇫🇷🇯🇵 emoji only at the start",
]


def _train(directory: Path) -> None:
    tok = HFTokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=420, min_frequency=1, special_tokens=["<s>", "</s>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(CORPUS, trainer)
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 0)])
    tok.save(str(directory / "tokenizer.json"))


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    directory = tmp_path_factory.mktemp("bpe")
    _train(directory)
    (directory / "config.json").write_text(json.dumps({"bos_token_id": 0, "eos_token_id": 1}))
    return directory


@pytest.fixture(scope="module")
def tok(model_dir: Path) -> Tokenizer:
    return Tokenizer.from_dir(model_dir)


def _stream(tok: Tokenizer, ids: list[int], prompt: list[int],
            stop: tuple[str, ...] = ()) -> tuple[TextStream, list[str]]:
    stream = TextStream(tok, prompt, stop)
    deltas = [stream.append(t) for t in ids]
    deltas.append(stream.flush())
    return stream, deltas


def test_samples_split_characters_across_tokens(tok: Tokenizer) -> None:
    # Guards the tests below: they only mean something if characters span several tokens.
    pieces = [tok.decode([t]) for s in SAMPLES for t in tok.encode(s, add_special_tokens=False)]
    assert sum(REPLACEMENT_CHAR in p for p in pieces) >= 5


@pytest.mark.parametrize("text", SAMPLES)
def test_stream_never_emits_partial_characters(tok: Tokenizer, text: str) -> None:
    ids = tok.encode(text, add_special_tokens=False)
    stream, deltas = _stream(tok, ids, tok.encode("Prompt: 你"))
    assert all(REPLACEMENT_CHAR not in d for d in deltas)
    assert "".join(deltas) == stream.text == tok.decode(ids) == text
    assert not stream.stopped and stream.token_ids == ids


@pytest.mark.parametrize("seed", range(20))
def test_stream_equals_decode_for_random_ids(tok: Tokenizer, seed: int) -> None:
    # Random ids include special tokens and lone bytes that never form valid UTF-8.
    rng = random.Random(seed)
    ids = [rng.randrange(tok.vocab_size) for _ in range(rng.randrange(1, 40))]
    prompt = [rng.randrange(tok.vocab_size) for _ in range(rng.randrange(0, 8))]
    stream, deltas = _stream(tok, ids, prompt)
    assert "".join(deltas) == stream.text == tok.decode(ids)


def test_prompt_ending_inside_a_character(tok: Tokenizer) -> None:
    ids = tok.encode("😀🎉 done", add_special_tokens=False)
    cut = next(i for i in range(1, len(ids)) if tok.decode(ids[:i]).endswith(REPLACEMENT_CHAR))
    stream, deltas = _stream(tok, ids[cut:], ids[:cut])
    assert "".join(deltas) == stream.text == tok.decode(ids[cut:])


def test_incomplete_character_at_the_end_is_released_by_flush(tok: Tokenizer) -> None:
    ids = tok.encode("ok 😀", add_special_tokens=False)
    cut = max(i for i in range(1, len(ids)) if tok.decode(ids[:i]).endswith(REPLACEMENT_CHAR))
    stream = TextStream(tok, [], ())
    streamed = "".join(stream.append(t) for t in ids[:cut])
    assert REPLACEMENT_CHAR not in streamed
    assert streamed + stream.flush() == stream.text == tok.decode(ids[:cut])
    assert stream.text.endswith(REPLACEMENT_CHAR)
    assert stream.append(ids[cut]) == "" and stream.flush() == ""


@pytest.mark.parametrize(("text", "stop", "expected"), [
    ("Hello 世界! 😀 ok", ("世界",), "Hello "),
    ("Hello 世界! 😀 ok", ("😀",), "Hello 世界! "),
    ("Hello 世界! 😀 ok", ("o 世", "ok"), "Hell"),
    ("naïve café 👍🏽 end", ("é 👍", "never"), "naïve caf"),
])
def test_stop_string_spanning_tokens_is_never_streamed(tok: Tokenizer, text: str,
                                                       stop: tuple[str, ...],
                                                       expected: str) -> None:
    ids = tok.encode(text, add_special_tokens=False)
    # The first stop string must not sit inside one token, or the test shows nothing.
    assert all(stop[0] not in tok.decode([t]) for t in ids)
    stream, deltas = _stream(tok, ids + ids, [], stop)
    assert stream.stopped
    assert "".join(deltas) == stream.text == expected
    assert stream.append(ids[0]) == ""


def test_possible_stop_prefix_is_held_then_released(tok: Tokenizer) -> None:
    stream = TextStream(tok, [], ("world peace",))
    released = ""
    for t in tok.encode("hello world", add_special_tokens=False):
        released += stream.append(t)
    assert released == "hello "
    for t in tok.encode(" wide", add_special_tokens=False):
        released += stream.append(t)
    released += stream.flush()
    assert released == stream.text == "hello world wide" and not stream.stopped


def test_held_stop_prefix_is_released_by_flush(tok: Tokenizer) -> None:
    ids = tok.encode("the end 世", add_special_tokens=False)
    stream, deltas = _stream(tok, ids, [], ("世界",))
    assert "".join(deltas[:-1]) == "the end "
    assert deltas[-1] == "世" and stream.text == "the end 世" and not stream.stopped


def _sentencepiece_style() -> Tokenizer:
    """A Llama-2-style tokenizer: `▁` for spaces, byte fallback, a decoder that strips the
    leading space of every decode."""
    backend = HFTokenizer(models.BPE(byte_fallback=True, unk_token="<unk>"))
    backend.normalizer = normalizers.Sequence([normalizers.Prepend("▁"),
                                               normalizers.Replace(" ", "▁")])
    backend.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(),
                                         decoders.Fuse(), decoders.Strip(" ", 1, 0)])
    backend.train_from_iterator(CORPUS, trainers.BpeTrainer(
        vocab_size=400, min_frequency=1, special_tokens=["<unk>", "<s>", "</s>"]))
    # Byte tokens are ordinary vocabulary entries (not special tokens) as in Llama 2's file.
    spec = json.loads(backend.to_str())
    vocab = spec["model"]["vocab"]
    for i in range(256):
        vocab.setdefault(f"<0x{i:02X}>", len(vocab))
    backend = HFTokenizer.from_str(json.dumps(spec))
    return Tokenizer(backend, bos_token_id=1, eos_token_ids=[2], add_bos_token=True)


def test_sentencepiece_continuation_keeps_its_leading_space() -> None:
    # A decode of the output alone drops the space before "time"; the prompt context keeps it,
    # as a client appending the stream to its prompt expects. 🦀 is not in the corpus, so it
    # arrives as four byte-fallback tokens.
    tok = _sentencepiece_style()
    ids = tok.encode("Once upon a time 🦀 世界", add_special_tokens=False)
    assert sum(tok.decode([t]) == REPLACEMENT_CHAR for t in ids) == 4
    cut = next(i for i, t in enumerate(ids) if tok.decode(ids[:i + 1]).endswith("a"))
    stream, deltas = _stream(tok, ids[cut + 1:], [1] + ids[:cut + 1])
    assert all(REPLACEMENT_CHAR not in d for d in deltas)
    assert "".join(deltas) == stream.text == " time 🦀 世界"
    assert tok.decode(ids[cut + 1:]) == "time 🦀 世界"


def test_stop_strings_wait_for_min_tokens(tok: Tokenizer) -> None:
    ids = tok.encode("ok 世界 and 世界 again", add_special_tokens=False)
    first = next(i for i in range(len(ids)) if "世界" in tok.decode(ids[:i + 1]))
    stream, deltas = _stream(tok, ids, [], ("世界",))
    assert stream.text == "ok "
    stream = TextStream(tok, [], ("世界",), min_tokens=first + 2)
    deltas = [stream.append(t) for t in ids] + [stream.flush()]
    assert stream.stopped and "".join(deltas) == stream.text == "ok 世界 and "


def test_empty_stop_string_is_rejected(tok: Tokenizer) -> None:
    with pytest.raises(ValueError, match="stop"):
        TextStream(tok, [], ("",))


# The window decoded by tokenizers' DecodeStream (Rust) against the same scheme in Python.


class _PythonDecode:
    """A tokenizer with `decode` alone: TextStream decodes its window in Python."""

    def __init__(self, tok: Tokenizer) -> None:
        self.decode = tok.decode


class _FailingStep:
    """The real tokenizer whose Rust decoder raises from the `fail_at`-th step on, as
    DecodeStream does when a window's text stops extending its prefix."""

    def __init__(self, tok: Tokenizer, fail_at: int) -> None:
        self.decode, self._tok, self._fail_at = tok.decode, tok, fail_at

    def decode_stream(self, context: list[int], skip_special_tokens: bool = True,
                      ) -> Callable[[int], str | None]:
        step = self._tok.decode_stream(context, skip_special_tokens)
        assert step is not None
        calls = 0

        def failing(token_id: int) -> str | None:
            nonlocal calls
            calls += 1
            if calls >= self._fail_at:
                raise RuntimeError("invalid prefix")
            return step(token_id)
        return failing


def _pieces(decoder: Any, ids: list[int], prompt: list[int], stop: tuple[str, ...],
            min_tokens: int, skip_special: bool) -> tuple[list[str], str, bool, str]:
    stream = TextStream(decoder, prompt, stop, skip_special_tokens=skip_special,
                        min_tokens=min_tokens)
    pieces = [stream.append(t) for t in ids] + [stream.flush()]
    return pieces, stream.text, stream.stopped, stream.stop_string


@pytest.mark.parametrize("style", ["byte-level", "sentencepiece"])
@pytest.mark.parametrize("seed", range(12))
def test_rust_window_releases_what_the_python_window_does(tok: Tokenizer, style: str,
                                                          seed: int) -> None:
    # Piece by piece, with partial characters, special tokens, stop strings (taken from the
    # output's own text, so some match and some only start to) and min_tokens.
    t = tok if style == "byte-level" else _sentencepiece_style()
    assert t.decode_stream([]) is not None  # this environment's tokenizers has it
    rng = random.Random(seed)
    text = SAMPLES[seed % len(SAMPLES)] * 2
    ids = t.encode(text, add_special_tokens=False)
    ids[rng.randrange(len(ids)):rng.randrange(len(ids))] = [
        rng.randrange(t.vocab_size) for _ in range(rng.randrange(8))]
    prompt = [rng.randrange(t.vocab_size) for _ in range(rng.randrange(0, 8))]
    at = rng.randrange(len(text) - 3)
    stop = (text[at:at + rng.randrange(1, 4)], "never") if seed % 3 else ()
    args = (ids, prompt, stop, rng.randrange(4) * (seed % 2), bool(seed % 4))
    python = _pieces(_PythonDecode(t), *args)
    assert _pieces(t, *args) == python
    # A Rust decoder that gives up midway hands its window to Python: the same pieces.
    assert _pieces(_FailingStep(t, 1 + seed % 5), *args) == python


def test_a_decode_stream_that_returns_its_context_is_not_used(
        model_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # A tokenizers version whose priming differed (here: the context's text returned on the
    # first step) would repeat the prompt; the probe finds it and the Python window is used.
    class Unprimed:
        def __init__(self, ids: list[int], skip_special_tokens: bool) -> None:
            self._stream = DecodeStream(skip_special_tokens=skip_special_tokens)
            self._context = list(ids)

        def step(self, backend: HFTokenizer, token_id: int) -> str | None:
            out = "".join(self._stream.step(backend, t) or "" for t in self._context)
            self._context = []
            return out + (self._stream.step(backend, token_id) or "") or None

    monkeypatch.setattr(tokenizer_module, "_DECODE_STREAM", Unprimed)
    tok = Tokenizer.from_dir(model_dir)
    assert tok.decode_stream([5, 6]) is None
    ids = tok.encode("Hello 世界! 😀 ok", add_special_tokens=False)
    stream, deltas = _stream(tok, ids, tok.encode("Prompt: 你"))
    assert "".join(deltas) == tok.decode(ids)


# Tokenizer: special ids from the directory's config files, and clear errors.


def test_tokenizer_reads_bos_and_eos(tok: Tokenizer) -> None:
    assert tok.bos_token_id == 0 and tok.eos_token_ids == (1,)
    assert tok.vocab_size == 420
    ids = tok.encode("Hello 世界")
    assert ids[0] == 0 and ids[1:] == tok.encode("Hello 世界", add_special_tokens=False)
    assert tok.decode(ids) == "Hello 世界"
    assert tok.decode(ids, skip_special_tokens=False) == "<s>Hello 世界"


def test_tokenizer_config_overrides_post_processor(tmp_path: Path) -> None:
    _train(tmp_path)
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({
        "bos_token": {"content": "<s>"}, "eos_token": "</s>", "add_bos_token": True}))
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [1, 5]}))
    tok = Tokenizer.from_dir(tmp_path)
    assert tok.eos_token_ids == (1, 5) and tok.bos_token_id == 0
    assert tok.encode("hi").count(0) == 1 and tok.encode("hi")[0] == 0
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"add_bos_token": False}))
    assert 0 not in Tokenizer.from_dir(tmp_path).encode("hi")


def test_tokenizer_matches_transformers(model_dir: Path, tok: Tokenizer) -> None:
    from transformers import PreTrainedTokenizerFast

    ref = PreTrainedTokenizerFast(tokenizer_file=str(model_dir / "tokenizer.json"))
    for text in SAMPLES:
        ids = tok.encode(text)
        assert ids == ref(text)["input_ids"]
        assert tok.decode(ids) == ref.decode(ids, skip_special_tokens=True)


def test_missing_or_invalid_tokenizer_json(tmp_path: Path) -> None:
    with pytest.raises(TokenizerError, match="tokenizer.json"):
        Tokenizer.from_dir(tmp_path)
    (tmp_path / "tokenizer.json").write_text("{not json")
    with pytest.raises(TokenizerError, match="not a valid tokenizers file"):
        Tokenizer.from_dir(tmp_path)
    _train(tmp_path)
    (tmp_path / "config.json").write_text("[")
    with pytest.raises(TokenizerError, match="config.json"):
        Tokenizer.from_dir(tmp_path)
