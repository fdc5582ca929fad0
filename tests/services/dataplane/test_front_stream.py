"""The worker front's side of a request: tokens from the engine core become chunks. A consumer
that falls behind gets every waiting token in one delta; a stop string cuts the tokens after it;
an error end carries no flushed text."""

from __future__ import annotations

import asyncio
from pathlib import Path

from services.worker import core_protocol as m
from services.worker.core_client import TokenStream
from services.worker.servicer import Detokenized
from slora_core.sampling_params import SamplingParams
from slora_core.tokenizer import Tokenizer


def feed(stream: TokenStream, ids: list[int]) -> None:
    for t in ids:
        stream.token_ids.append(t)
        stream.logprobs.append(-0.5)
        stream.top.append([(t, -0.5)])
    stream.event.set()


def test_waiting_tokens_come_as_one_delta_then_the_end(demo_dir: Path) -> None:
    tok = Tokenizer.from_dir(demo_dir / "model")
    ids = tok.encode("the quick brown fox jumps over the lazy dog")

    async def scenario() -> None:
        s = TokenStream()
        d = Detokenized(tok, [5], SamplingParams(max_new_tokens=64), s)
        feed(s, ids[:3])
        feed(s, ids[3:])
        assert d.ready()
        delta, finish = d.take()
        assert delta.token_ids == ids and finish is None
        assert len(delta.logprobs) == len(ids) == len(delta.top)
        s.finish = m.Finish(1, "length")
        s.event.set()
        assert d.ready()
        end, finish = d.take()
        assert finish is not None and finish.reason == "length" and end.token_ids == []
        assert delta.text + end.text == tok.decode(ids)
        assert d.completion_tokens == len(ids)

    asyncio.run(scenario())


def test_a_stop_string_cuts_the_tokens_after_it(demo_dir: Path) -> None:
    tok = Tokenizer.from_dir(demo_dir / "model")
    ids = tok.encode(" one two three four five")

    async def scenario() -> None:
        s = TokenStream()
        d = Detokenized(tok, [5], SamplingParams(max_new_tokens=64, stop=("three",)), s)
        feed(s, ids)
        assert d.ready()
        delta, finish = d.take()
        assert finish is not None and finish.reason == "stop"
        assert "three" not in delta.text and delta.text.strip().startswith("one two")
        # The token that completed the stop string is the last one sent, as in the engine.
        assert tok.decode(delta.token_ids).rstrip().endswith("three")
        assert len(delta.token_ids) < len(ids) and d.completion_tokens == len(delta.token_ids)

    asyncio.run(scenario())


def test_an_error_end_flushes_no_text(demo_dir: Path) -> None:
    tok = Tokenizer.from_dir(demo_dir / "model")

    async def scenario() -> None:
        s = TokenStream()
        d = Detokenized(tok, [5], SamplingParams(max_new_tokens=64, stop=("zzzz",)), s)
        feed(s, tok.encode(" zz"))  # held back: it could grow into the stop string
        s.finish = m.Finish(1, "error", "the engine core exited", "UNAVAILABLE")
        assert d.ready()
        delta, finish = d.take()
        assert finish is not None and finish.code == "UNAVAILABLE"
        assert "zz" not in delta.text

    asyncio.run(scenario())


def test_engine_ends_map_to_status_codes() -> None:
    """How the core reports a finished request's end: a non-finite row is INTERNAL with the
    engine's message, an adapter that cannot load is an adapter error (the gateway falls back),
    a deadline is DEADLINE_EXCEEDED; ordinary ends carry no code."""
    from services.worker.engine_core import finish_of
    from slora_core.outputs import (
        ADAPTER_UNLOADABLE,
        DEADLINE,
        NONFINITE,
        NONFINITE_LOGITS,
        RequestOutput,
        nonfinite_logits_error,
    )

    nan = finish_of(7, RequestOutput("7", finished=True, finish_reason="error",
                                     error=nonfinite_logits_error(3), error_kind=NONFINITE))
    assert (nan.rid, nan.reason, nan.code, nan.kind) == (7, "error", "INTERNAL", NONFINITE)
    assert nan.error.startswith(NONFINITE_LOGITS) and not nan.adapter_error
    bad = finish_of(1, RequestOutput("1", finished=True, finish_reason="error",
                                     error="adapter 'a@v1' could not be loaded: gone",
                                     error_kind=ADAPTER_UNLOADABLE))
    assert bad.code == "FAILED_PRECONDITION" and bad.adapter_error
    late = finish_of(2, RequestOutput("2", finished=True, finish_reason="abort",
                                      error="deadline exceeded before the request was scheduled",
                                      error_kind=DEADLINE))
    assert late.code == "DEADLINE_EXCEEDED" and not late.adapter_error
    assert finish_of(3, RequestOutput("3", finished=True, finish_reason="length")).code == ""
