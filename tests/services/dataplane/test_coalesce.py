"""A stream that falls behind sends one chunk for the deltas already waiting, never past the
end of the request or an error."""

from __future__ import annotations

import asyncio

import pytest

from services.worker.servicer import coalesce
from slora_core.outputs import RequestOutput, TokenLogprob, merge_outputs


def out(tokens: list[int], text: str, finished: bool = False) -> RequestOutput:
    return RequestOutput("r", token_ids=tokens, text=text,
                         logprobs=[TokenLogprob(t, -0.5) for t in tokens], finished=finished,
                         finish_reason="length" if finished else None,
                         completion_tokens=tokens[-1])


def test_waiting_deltas_merge_into_one_up_to_the_end():
    q: asyncio.Queue = asyncio.Queue()
    for item in (out([2], "b"), out([3], "c", finished=True), out([9], "late")):
        q.put_nowait(item)
    merged = coalesce(out([1], "a"), q)
    assert merged.token_ids == [1, 2, 3] and merged.text == "abc"
    assert [lp.token_id for lp in merged.logprobs] == [1, 2, 3]
    assert merged.finished and merged.finish_reason == "length" and merged.completion_tokens == 3
    assert q.qsize() == 1  # nothing past the finished delta is taken


def test_an_error_behind_the_delta_is_raised():
    q: asyncio.Queue = asyncio.Queue()
    q.put_nowait(RuntimeError("engine step failed"))
    with pytest.raises(RuntimeError, match="engine step failed"):
        coalesce(out([1], "a"), q)


def test_merging_two_requests_is_refused():
    with pytest.raises(ValueError, match="cannot merge"):
        merge_outputs(out([1], "a"), RequestOutput("other"))
