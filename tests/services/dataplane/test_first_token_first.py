"""The worker front wakes a step's streams in order, tens of microseconds of event-loop work
each: a request whose first token came in this step is woken ahead of the running streams, so
its TTFT does not wait behind every other stream's token (issue 37)."""

from __future__ import annotations

import asyncio
from pathlib import Path

from services.worker import core_protocol as m
from services.worker.core_client import CoreClient, TokenStream
from slora_core.config import EngineConfig


def test_a_first_token_is_woken_before_the_running_streams() -> None:
    async def run() -> list[int]:
        client = CoreClient(Path("unused"), EngineConfig())
        woken: list[int] = []
        streams = {rid: TokenStream() for rid in (1, 2, 3, 4)}
        for rid in (1, 2, 4):
            streams[rid].streamed = True  # these have sent tokens already
        client.streams = dict(streams)

        async def consume(rid: int) -> None:
            await streams[rid].event.wait()
            woken.append(rid)

        tasks = [asyncio.create_task(consume(rid)) for rid in streams]
        await asyncio.sleep(0)  # every consumer waits on its event
        client._dispatch(m.StepOutput(rids=[1, 2, 3, 4], token_ids=[5, 6, 7, 8],
                                      logprobs=[0.0] * 4, top=None,
                                      finished=[m.Finish(4, "length")], started=[],
                                      state=m.EngineState()))
        await asyncio.gather(*tasks)
        assert [s.token_ids for s in streams.values()] == [[5], [6], [7], [8]]
        assert streams[3].streamed and 4 not in client.streams
        return woken

    woken = asyncio.run(run())
    assert woken[0] == 3, woken  # the first token, ahead of the step's order
    assert sorted(woken) == [1, 2, 3, 4]
