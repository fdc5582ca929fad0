"""The worker front wakes a step's streams in order, tens of microseconds of event-loop work
each: a request whose first token came in this step is woken ahead of the running streams, so
its TTFT does not wait behind every other stream's token (issue 37), and so is a request the
step finishes, whose end a closed-loop client waits for. Over GenerateMux those also leave in
a frame of their own: the mux's writer, woken by their consumers, runs before the running
streams' consumers (CoreClient._deliver)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator, AsyncIterator
from pathlib import Path

from services.worker import core_protocol as m
from services.worker.core_client import CoreClient, TokenStream
from services.worker.mux import MuxSession
from slora.v1 import inference_pb2 as pb
from slora_core.config import EngineConfig


def step(rids: list[int], finished: tuple[int, ...] = ()) -> m.StepOutput:
    return m.StepOutput(rids=rids, token_ids=[r + 4 for r in rids], logprobs=[0.0] * len(rids),
                        top=None, finished=[m.Finish(r, "length") for r in finished],
                        started=[], state=m.EngineState())


def client_with(rids: tuple[int, ...], first: int) -> tuple[CoreClient, dict[int, TokenStream]]:
    """A CoreClient (no core process) whose streams `rids` have all streamed but `first`."""
    client = CoreClient(Path("unused"), EngineConfig())
    streams = {rid: TokenStream() for rid in rids}
    for rid in rids:
        streams[rid].streamed = rid != first
    client.streams = dict(streams)
    return client, streams


def test_a_first_token_is_woken_before_the_running_streams() -> None:
    async def run() -> list[int]:
        client, streams = client_with((1, 2, 3, 4), first=3)
        woken: list[int] = []

        async def consume(rid: int) -> None:
            await streams[rid].event.wait()
            woken.append(rid)

        tasks = [asyncio.create_task(consume(rid)) for rid in streams]
        await asyncio.sleep(0)  # every consumer waits on its event
        await client._deliver(step([1, 2, 3, 4], finished=(4,)))
        await asyncio.gather(*tasks)
        assert [s.token_ids for s in streams.values()] == [[5], [6], [7], [8]]
        assert streams[3].streamed and 4 not in client.streams
        return woken

    woken = asyncio.run(run())
    # The first token, then the finished request, ahead of the step's order.
    assert woken[:2] == [3, 4], woken
    assert sorted(woken) == [1, 2, 3, 4]


def test_a_running_stream_whose_tokens_were_taken_in_the_turn_is_not_woken() -> None:
    """The running streams are woken a loop turn after the first tokens; a consumer that ran
    in that turn (it was not waiting) took its token already, and its event stays clear: a
    set event with nothing in it would send `Served.wait` back at once."""
    async def run() -> None:
        client, streams = client_with((1, 2, 3), first=3)
        delivered = asyncio.create_task(client._deliver(step([1, 2, 3])))
        await asyncio.sleep(0)  # _deliver woke the first token and yields its turn
        assert streams[3].event.is_set() and not streams[1].event.is_set()
        streams[1].take()  # stream 1's consumer runs in that turn
        await delivered
        assert not streams[1].event.is_set() and streams[1].token_ids == []
        assert streams[2].event.is_set() and streams[3].event.is_set()

    asyncio.run(run())


def test_a_step_without_first_tokens_wakes_every_stream_at_once() -> None:
    async def run() -> None:
        client, streams = client_with((1, 2), first=0)
        waits = [asyncio.create_task(s.event.wait()) for s in streams.values()]
        await asyncio.sleep(0)
        await client._deliver(step([1, 2]))
        assert all(s.event.is_set() for s in streams.values())
        await asyncio.gather(*waits)

    asyncio.run(run())


def mux_frames(rids: tuple[int, ...], first: int, finished: tuple[int, ...] = (),
               ) -> list[list[int]]:
    """The real MuxSession writer over streams the real CoreClient feeds, one step delivered:
    the stream ids each down frame carries items for, in order."""

    async def run() -> list[list[int]]:
        client, streams = client_with(rids, first=first)

        async def serve(req: pb.GenerateRequest, tenant: str, timeout: float | None,
                        ) -> AsyncGenerator[pb.GenerateResponse, None]:
            s = streams[int(req.request_id)]
            while True:
                if not s.token_ids and s.finish is None:
                    await s.event.wait()
                ids, _, _ = s.take()
                if ids:
                    yield pb.GenerateResponse(chunk=pb.Chunk(token_ids=ids))
                if s.finish is not None:
                    yield pb.GenerateResponse(complete=pb.Complete(finish_reason="length"))
                    return

        opened = asyncio.Event()
        done = asyncio.Event()

        async def up() -> AsyncIterator[pb.MuxUp]:
            yield pb.MuxUp(requests=[pb.MuxRequest(
                stream_id=rid, request=pb.GenerateRequest(request_id=str(rid)))
                for rid in rids])
            opened.set()
            await done.wait()

        session = MuxSession(serve)
        frames = session.frames(up())
        frames_seen: list[list[int]] = []

        async def write() -> None:  # as gRPC drives a response-streaming handler
            async for frame in frames:
                frames_seen.append(sorted({item.stream_id for item in frame.items}))
                if sum(map(len, frames_seen)) == len(rids):
                    done.set()
                    return

        writer = asyncio.create_task(write())
        await opened.wait()
        for _ in range(3):  # every request's task reaches its stream's wait
            await asyncio.sleep(0)
        await client._deliver(step(list(rids), finished=finished))
        await asyncio.wait_for(writer, 5)
        await frames.aclose()
        return frames_seen

    return asyncio.run(run())


def test_over_the_mux_a_first_token_leaves_in_a_frame_of_its_own() -> None:
    """Of 8 streams, one gets its first token in the step; the first down frame carries it
    alone, the next one the other 7 streams' tokens."""
    rids = tuple(range(1, 9))
    seen = mux_frames(rids, first=5)
    assert seen[0] == [5], seen
    assert sorted(r for frame in seen for r in frame) == list(rids)
    assert seen[1:] == [[r for r in rids if r != 5]], seen


def test_over_the_mux_a_finished_request_leaves_with_the_first_tokens() -> None:
    """A request the step finishes sends its last chunk and its `complete` in the first frame,
    beside the first token, before the running streams' chunks."""
    rids = tuple(range(1, 9))
    seen = mux_frames(rids, first=5, finished=(7,))
    assert seen[0] == [5, 7], seen
    assert seen[1:] == [[r for r in rids if r not in (5, 7)]], seen
