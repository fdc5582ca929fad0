"""The worker front over a gateway's mux, streams pumped by the writer (services/worker/mux.py):
the real WorkerServicer and MuxSession over a CoreClient whose core is stepped by hand. Each
stream's responses equal the per-call Generate's; deadlines, cancels and engine errors end
(or drop) only their stream and free it in the core; the writer's time budget splits a
step's delivery into frames; the worker's count of requests in flight returns to zero."""

from __future__ import annotations

import asyncio
import subprocess
import sys
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any, cast

import grpc
import pytest

from services.worker import core_protocol as m
from services.worker import mux
from services.worker.core_client import CoreClient
from services.worker.metrics import WorkerMetrics
from services.worker.mux import MuxSession
from services.worker.servicer import WorkerServicer
from slora.v1 import inference_pb2 as pb
from slora_core.config import EngineConfig
from slora_core.tokenizer import Tokenizer


class HandCore(CoreClient):
    """A CoreClient with no process: `step()` gives every running request one token and
    ends those that reached their max_new_tokens (or, for rids in `fail`, an engine error)."""

    def __init__(self, model_dir: Path) -> None:
        super().__init__(model_dir, EngineConfig(device="cpu"))
        self.ready = m.Ready(max_num_seqs=64, max_model_len=512, eos_token_ids=[])
        self.left: dict[int, int] = {}
        self.aborted: list[int] = []
        self.fail: set[int] = set()

    def _send(self, msg: m.ToCore) -> None:
        if isinstance(msg, m.AddRequest):
            self.left[msg.rid] = msg.sampling.max_new_tokens or 16
        elif isinstance(msg, m.Abort):
            for rid in msg.rids:
                if self.left.pop(rid, None) is not None:
                    self.aborted.append(rid)

    async def step(self) -> None:
        rids = list(self.left)
        finished = []
        tokens = []
        for rid in rids:
            self.left[rid] -= 1
            tokens.append(7 + self.left[rid])  # the same for the same request, run again
            if rid in self.fail:
                del self.left[rid]
                finished.append(m.Finish(rid, "error", "boom", "INTERNAL"))
            elif self.left[rid] == 0:
                del self.left[rid]
                finished.append(m.Finish(rid, "length"))
        await self._deliver(m.StepOutput(rids, tokens,
                                         [-0.5] * len(rids), None, finished, [],
                                         m.EngineState(running=len(rids))))


def request(sid: int, new_tokens: int, timeout_s: float | None = None) -> pb.MuxRequest:
    req = pb.MuxRequest(stream_id=sid, tenant="t", request=pb.GenerateRequest(
        request_id=f"r{sid}", token_ids=pb.TokenIds(ids=[1, 5, 6, 7 + sid % 30]),
        sampling=pb.SamplingOptions(temperature=0, max_new_tokens=new_tokens,
                                    ignore_eos=True)))
    if timeout_s is not None:
        req.timeout_s = timeout_s
    return req


class Session:
    """One mux session over a HandCore: `send` up-frames, `steps` to run the core, `frames`
    holds every down frame the writer yielded (each written with a loop turn, as gRPC's)."""

    def __init__(self, demo_dir: Path, pump_s: float = 0.0) -> None:
        model = demo_dir / "model"
        self.core = HandCore(model)
        self.servicer = WorkerServicer("w", self.core, Tokenizer.from_dir(model),
                                       cast(Any, None), WorkerMetrics())
        self.mux = MuxSession(self.servicer.serve, self.servicer.open)
        self.mux.pump_budget_s = pump_s
        self.up: asyncio.Queue[pb.MuxUp | None] = asyncio.Queue()
        self.frames: list[pb.MuxDown] = []
        self._writer = asyncio.create_task(self._write())

    async def _ups(self) -> AsyncIterator[pb.MuxUp]:
        while (frame := await self.up.get()) is not None:
            yield frame

    async def _write(self) -> None:
        async for frame in self.mux.frames(self._ups()):
            self.frames.append(frame)
            await asyncio.sleep(0)

    async def send(self, *reqs: pb.MuxRequest, cancels: tuple[int, ...] = ()) -> None:
        self.up.put_nowait(pb.MuxUp(requests=reqs, cancels=cancels))
        for _ in range(5):  # the reader, then each request's `open` to the core
            await asyncio.sleep(0)

    async def steps(self, n: int) -> None:
        for _ in range(n):
            await self.core.step()
            for _ in range(100):  # every frame written (a loop turn each)
                await asyncio.sleep(0)

    async def close(self) -> None:
        """The gateway half-closes: the session ends once its streams have."""
        self.up.put_nowait(None)
        await asyncio.wait_for(self._writer, 5)

    async def cancel(self) -> None:
        """The call is cancelled (gRPC cancels the writer): every stream is freed."""
        self._writer.cancel()
        await asyncio.gather(self._writer, return_exceptions=True)

    def items(self, sid: int) -> list[pb.GenerateResponse]:
        return [i.response for f in self.frames for i in f.items if i.stream_id == sid]

    def ends(self) -> dict[int, pb.MuxEnd]:
        return {e.stream_id: e for f in self.frames for e in f.ends}


async def per_call(servicer: WorkerServicer, core: HandCore, req: pb.MuxRequest,
                   ) -> list[pb.GenerateResponse]:
    """The same request through `serve` (a per-call Generate's path), the core stepped."""
    out: list[pb.GenerateResponse] = []

    async def consume() -> None:
        async for r in servicer.serve(req.request, req.tenant, None):
            out.append(r)

    task = asyncio.create_task(consume())
    while not task.done():
        await asyncio.sleep(0)
        await core.step()
    await task
    return out


def test_pumped_streams_answer_as_per_call_and_leave_nothing_in_flight(demo_dir: Path) -> None:
    async def run() -> None:
        s = Session(demo_dir)
        await s.send(*(request(sid, 3 + sid) for sid in range(1, 5)))
        await s.steps(9)
        assert set(s.ends()) == {1, 2, 3, 4}
        assert all(not e.code for e in s.ends().values())
        await s.close()
        assert s.servicer.inflight == 0 and not s.core.left and not s.core.streams
        for sid in range(1, 5):
            want = await per_call(s.servicer, s.core, request(sid, 3 + sid))
            got = s.items(sid)
            assert [r.WhichOneof("event") for r in got] == [r.WhichOneof("event") for r in want]
            assert got == want  # chunks written in place: ids, text, logprobs, the complete
            assert [lp.token_id for r in got for lp in r.chunk.logprobs] == [
                t for r in got for t in r.chunk.token_ids] and got[0].chunk.logprobs[0].token
            assert got[-1].complete.usage.completion_tokens == 3 + sid
            assert got[0].chunk.prompt_tokens == 4  # the first chunk's prompt fields

    asyncio.run(run())


def test_a_pumped_streams_deadline_ends_it_and_frees_it_in_the_core(demo_dir: Path) -> None:
    async def run() -> None:
        s = Session(demo_dir)
        await s.send(request(1, 50, timeout_s=0.05), request(2, 3))
        await s.steps(2)
        rid = next(iter(s.core.left))
        await asyncio.sleep(0.1)
        await s.steps(2)
        end = s.ends()[1]
        assert end.code == grpc.StatusCode.DEADLINE_EXCEEDED.value[0]
        assert rid in s.core.aborted and rid not in s.core.left
        assert not s.ends()[2].code and len(s.items(2)) == 4  # 3 chunks and the complete
        await s.close()
        assert s.servicer.inflight == 0

    asyncio.run(run())


def test_a_cancelled_pumped_stream_gets_no_end_and_is_freed(demo_dir: Path) -> None:
    async def run() -> None:
        s = Session(demo_dir)
        await s.send(request(1, 50), request(2, 50))
        await s.steps(2)
        await s.send(cancels=(1,))
        await s.steps(2)
        assert 1 not in s.ends() and len(s.items(1)) == 2
        assert len(s.core.aborted) == 1 and len(s.core.left) == 1
        assert len(s.items(2)) == 4
        await s.cancel()  # the call's end frees the other one
        assert s.servicer.inflight == 0 and not s.core.left and len(s.core.aborted) == 2

    asyncio.run(run())


def test_an_engine_error_ends_its_stream_only_with_its_code(demo_dir: Path) -> None:
    async def run() -> None:
        s = Session(demo_dir)
        await s.send(request(1, 5), request(2, 5))
        await s.steps(1)
        s.core.fail.add(min(s.core.left))
        await s.steps(5)
        ends = s.ends()
        assert ends[1].code == grpc.StatusCode.INTERNAL.value[0] and "boom" in ends[1].message
        assert not ends[2].code and s.items(2)[-1].complete.usage.completion_tokens == 5
        await s.close()
        assert s.servicer.inflight == 0

    asyncio.run(run())


def test_the_writers_budget_splits_a_steps_delivery_into_frames(demo_dir: Path) -> None:
    """With no budget a step's tokens for 40 streams go in one frame; with a budget too short
    for one stream's pump each frame carries one stream, and every token still arrives."""
    async def run(pump_s: float) -> list[int]:
        s = Session(demo_dir, pump_s)
        await s.send(*(request(sid, 4) for sid in range(1, 41)))
        await s.steps(1)  # first tokens: a frame of their own (they leave ahead)
        before = len(s.frames)
        await s.steps(1)
        sizes = [len(f.items) for f in s.frames[before:]]
        await s.steps(2)
        await s.close()
        for sid in range(1, 41):  # 4 tokens each (a late pump's chunk may hold two)
            got = s.items(sid)
            assert sum(len(r.chunk.token_ids) for r in got) == 4
            assert got[-1].complete.usage.completion_tokens == 4
        return sizes

    assert asyncio.run(run(0.0)) == [40]
    assert asyncio.run(run(1e-9)) == [1] * 40


def test_a_frame_past_the_size_cap_is_cut_in_halves_and_loses_nothing(
        demo_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A step's 16 chunks past MAX_DOWN_FRAME_BYTES go out as 8 and then 4, 2, 1, 1: the ends
    after every item, each stream's items in order."""
    monkeypatch.setattr(mux, "MAX_DOWN_FRAME_BYTES", 1)

    async def run() -> None:
        s = Session(demo_dir)
        await s.send(*(request(sid, 3) for sid in range(1, 17)))
        await s.steps(1)
        before = len(s.frames)
        await s.steps(1)
        assert [len(f.items) for f in s.frames[before:]] == [8, 4, 2, 1, 1]
        await s.steps(2)
        await s.close()
        for sid in range(1, 17):
            got = s.items(sid)
            assert [len(r.chunk.token_ids) for r in got[:-1]] == [1, 1, 1]
            assert got[-1].complete.usage.completion_tokens == 3
        last_item = max(i for i, f in enumerate(s.frames) if f.items)
        assert all(not f.ends for f in s.frames[:last_item]) and len(s.ends()) == 16

    asyncio.run(run())


def test_a_wake_after_its_tokens_were_taken_does_not_end_the_next_wait(demo_dir: Path) -> None:
    """A wake that finds nothing to pump (CoreClient._deliver used to wake running streams
    whose consumers had taken their tokens in the turn before) must not end the next wait:
    returning at once, `serve` would loop without yielding and the worker's loop would never
    turn again (a hang seen under load)."""
    async def run() -> None:
        s = Session(demo_dir)
        served = await s.servicer.open(request(1, 5).request, "t", None)
        await s.core.step()
        assert served.pump()  # the first token's chunk
        assert served._stream is not None
        served._stream.tokens.wake()  # a stray wake: its token is already taken
        with pytest.raises(TimeoutError):  # wait returning here would have nothing to pump
            await asyncio.wait_for(served.wait(), 0.05)
        waiting = asyncio.create_task(served.wait())
        await s.core.step()
        await asyncio.wait_for(waiting, 1)  # a real token ends it
        assert served.pump()
        served.close()
        await s.cancel()
        assert s.servicer.inflight == 0

    asyncio.run(run())


def test_a_stream_resumed_past_its_end_gets_its_end_without_the_core(demo_dir: Path) -> None:
    """A resumed request whose client already holds every token (the first worker finished,
    only its end was lost): the end is pumped at once, and nothing reaches the core."""
    async def run() -> None:
        s = Session(demo_dir)
        req = request(1, 3)
        req.request.resume_token_ids.extend([9, 10, 11])
        await s.send(req)
        await s.steps(1)
        assert not s.ends()[1].code
        (complete,) = [r for r in s.items(1) if r.HasField("complete")]
        assert complete.complete.finish_reason == "length"
        assert complete.complete.usage.completion_tokens == 3
        assert not s.core.left and not s.core.aborted
        await s.close()
        assert s.servicer.inflight == 0

    asyncio.run(run())


def test_the_worker_refuses_a_pump_time_out_of_range() -> None:
    res = subprocess.run([sys.executable, "-m", "services.cli", "worker", "--model", "/none",
                          "--control-plane", "127.0.0.1:1", "--mux-pump-ms", "-1"],
                         capture_output=True, text=True, timeout=60)
    assert res.returncode != 0 and "--mux-pump-ms must be in [0, 1000]" in res.stderr


def test_a_request_arriving_mid_delivery_is_handed_over_before_the_next_slice(
        demo_dir: Path) -> None:
    """A successor that arrives while the writer works through a step's slices reaches the
    core after the frame being written, not after more slices."""
    async def run() -> int:
        s = Session(demo_dir, pump_s=1e-9)  # one stream a frame
        await s.send(*(request(sid, 8) for sid in range(1, 41)))
        await s.steps(2)
        await s.core.step()  # a step's tokens for 40 streams: 40 slices
        for _ in range(3):
            await asyncio.sleep(0)
        written = len(s.frames)
        rids = set(s.core.left)
        s.up.put_nowait(pb.MuxUp(requests=[request(99, 2)]))
        while set(s.core.left) == rids:
            await asyncio.sleep(0)
        slices = len(s.frames) - written
        await s.steps(8)
        await s.close()
        assert s.items(99)[-1].complete.usage.completion_tokens == 2
        return slices

    assert asyncio.run(run()) <= 1
