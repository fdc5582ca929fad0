"""The gateway's SSE events: a chunk event (header encoded once, choice per event) is the JSON
object OpenAI's stream chunk is, for completions and chat, with and without usage; a streamed
response ends with the last finish event, the usage and [DONE] in one write."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from typing import Any

from services.gateway.http_api import HttpApi
from services.gateway.metrics import GatewayMetrics
from services.gateway.openai_responses import DONE, ChoiceState, Header, Shape, StreamEvents
from slora.v1 import inference_pb2 as pb

HEADER = {"id": "cmpl-1", "created": 7, "model": "m", "system_fingerprint": "a@v1"}


def chunk(text: str) -> pb.GenerateResponse:
    return pb.GenerateResponse(chunk=pb.Chunk(token_ids=[1], text=text))


def complete(tokens: int) -> pb.GenerateResponse:
    return pb.GenerateResponse(complete=pb.Complete(
        finish_reason="length", usage=pb.Usage(prompt_tokens=3, completion_tokens=tokens)))


def parsed(event: bytes) -> dict[str, Any]:
    assert event.startswith(b"data: ") and event.endswith(b"\n\n")
    return dict(json.loads(event[6:]))


def test_completion_events() -> None:
    header = Header("completion", "cmpl-1", "m", "a@v1", created=7)
    events = StreamEvents(header, Shape(), include_usage=True)
    c = ChoiceState(0)
    first = parsed(events.chunk(c, chunk("héllo \"x\"")))
    assert first == {**HEADER, "object": "text_completion", "usage": None, "choices": [
        {"index": 0, "logprobs": None, "finish_reason": None, "text": "héllo \"x\""}]}
    last = parsed(events.chunk(c, complete(1)))
    assert last["choices"] == [{"index": 0, "logprobs": None, "finish_reason": "length",
                                "text": ""}]


def test_chat_events_carry_the_role_first_and_no_usage_key_unless_asked() -> None:
    header = Header("chat", "chatcmpl-1", "m", "a@v1", created=7)
    events = StreamEvents(header, Shape(), include_usage=False)
    c = ChoiceState(1)
    first = parsed(events.chunk(c, chunk("hi")))
    assert first == {**HEADER, "id": "chatcmpl-1", "object": "chat.completion.chunk",
                     "choices": [{"index": 1, "logprobs": None, "finish_reason": None,
                                  "delta": {"content": "hi", "role": "assistant"}}]}
    assert parsed(events.chunk(c, chunk("!")))["choices"][0]["delta"] == {"content": "!"}
    assert parsed(events.chunk(c, complete(2)))["choices"][0]["delta"] == {}


class FakeFanout:
    def __init__(self, items: list[tuple[int, pb.GenerateResponse]]) -> None:
        self.items, self.calls, self.closed = items, [object()], False

    async def events(self) -> AsyncIterator[tuple[int, pb.GenerateResponse]]:
        for item in self.items:
            yield item

    async def close(self) -> None:
        self.closed = True


def test_the_end_of_a_stream_is_one_write() -> None:
    api = HttpApi(router=None, metrics=GatewayMetrics(), base_model="m")  # type: ignore[arg-type]
    header = Header("completion", "cmpl-1", "m", "a@v1", created=7)
    fanout = FakeFanout([(0, chunk("a")), (1, chunk("b")), (0, complete(1)), (1, chunk("c")),
                         (1, complete(2))])
    choices = [ChoiceState(0), ChoiceState(1)]

    async def run() -> list[bytes]:
        stream = api._stream(fanout, StreamEvents(header, Shape(), True),  # type: ignore[arg-type]
                             choices, 2, True)
        return [w async for w in stream]

    writes = asyncio.run(run())
    assert fanout.closed
    # a, b, choice 0's finish (choice 1 still runs), c, then one write for the rest
    assert len(writes) == 5
    assert parsed(writes[2])["choices"][0]["finish_reason"] == "length"
    events = writes[4].split(b"\n\n")
    assert events[-1] == b"" and events[-2] + b"\n\n" == DONE
    assert parsed(events[0] + b"\n\n")["choices"][0] == {
        "index": 1, "logprobs": None, "finish_reason": "length", "text": ""}
    assert parsed(events[1] + b"\n\n")["usage"] == {"prompt_tokens": 3, "completion_tokens": 3,
                                                     "total_tokens": 6,
                                                     "prompt_tokens_details": {"cached_tokens": 0}}
