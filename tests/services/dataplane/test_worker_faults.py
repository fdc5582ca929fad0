"""The two-process worker under faults: the engine core killed mid-stream, the front killed,
and many concurrent streams with cancels (nothing leaks in the engine core)."""

from __future__ import annotations

import asyncio
import os
import re
import signal
import threading
import time
from pathlib import Path

import grpc
import pytest

from services.common.processes import Child, free_port, slora_argv, start_child, wait_serving
from services.worker.debug_hooks import STEP_DELAY_ENV
from slora.v1 import inference_pb2_grpc as pb_grpc
from tests.services.dataplane.dp_support import request, scrape

pytestmark = pytest.mark.timeout(240)
CORE_PID = re.compile(r"engine core pid (\d+)")


def start_worker(demo_dir: Path, tmp_path: Path, *extra: str,
                 env: dict[str, str] | None = None) -> tuple[Child, str, int, int]:
    """A worker on its own (base-model calls need no control plane): (child, address,
    metrics port, engine-core pid)."""
    address, metrics = f"127.0.0.1:{free_port()}", free_port()
    worker = start_child("worker", slora_argv(
        "worker", "--model", str(demo_dir / "model"), "--control-plane",
        f"127.0.0.1:{free_port()}", "--listen", address, "--worker-id", "faults",
        "--metrics-port", str(metrics), "--cache-dir", str(tmp_path / "cache"), *extra), tmp_path,
        env)
    wait_serving(address, worker, timeout_s=120)
    found = CORE_PID.search(worker.log_path.read_text())
    assert found, worker.log_path.read_text()
    return worker, address, metrics, int(found.group(1))


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # A zombie (exited, not yet reaped by its dead parent's reaper) holds no GPU.
    with open(f"/proc/{pid}/stat") as f:
        return f.read().split(") ", 1)[1][0] != "Z"


def test_engine_core_killed_mid_stream_ends_every_stream_unavailable_and_the_worker_exits(
        demo_dir: Path, tmp_path: Path) -> None:
    # 10 ms steps (a test hook): the streams are surely mid-generation when the core dies.
    worker, address, _, core_pid = start_worker(demo_dir, tmp_path, env={STEP_DELAY_ENV: "0.01"})
    ended: dict[int, tuple[grpc.StatusCode | None, str, float]] = {}
    started = threading.Barrier(5)

    def stream(i: int) -> None:
        with grpc.insecure_channel(address) as channel:
            call = pb_grpc.InferenceServiceStub(channel).Generate(
                request(max_new_tokens=450, ignore_eos=True, temperature=0), timeout=120)
            try:
                next(call)
                started.wait(60)
                for _ in call:
                    pass
                ended[i] = (None, "", time.monotonic())
            except grpc.RpcError as e:
                ended[i] = (e.code(), e.details() or "", time.monotonic())

    threads = [threading.Thread(target=stream, args=(i,)) for i in range(4)]
    try:
        for t in threads:
            t.start()
        started.wait(60)  # every stream has its first chunk
        killed = time.monotonic()
        os.kill(core_pid, signal.SIGKILL)
        for t in threads:
            t.join(30)
        assert len(ended) == 4
        for code, details, at in ended.values():
            assert code == grpc.StatusCode.UNAVAILABLE, (code, details)
            assert "engine core exited" in details
            assert at - killed < 1.0, at - killed
        assert worker.popen.wait(20) != 0  # the supervisor restarts it
    finally:
        worker.kill()


def test_front_killed_takes_the_engine_core_with_it(demo_dir: Path, tmp_path: Path) -> None:
    worker, _, _, core_pid = start_worker(demo_dir, tmp_path)
    try:
        assert alive(core_pid)
        worker.popen.kill()
        killed = time.monotonic()
        while alive(core_pid):
            assert time.monotonic() - killed < 2.0, "the engine core outlived its front"
            time.sleep(0.02)
    finally:
        worker.kill()
        if alive(core_pid):
            os.kill(core_pid, signal.SIGKILL)


def test_200_streams_with_cancels_leave_nothing_behind(demo_dir: Path, tmp_path: Path) -> None:
    worker, address, metrics, _ = start_worker(demo_dir, tmp_path, "--max-num-seqs", "64",
                                               "--num-pages", "256")

    async def one(stub: pb_grpc.InferenceServiceStub, i: int) -> str:
        call = stub.Generate(request(max_new_tokens=400 if i % 2 else 6, ignore_eos=True,
                                     temperature=0), timeout=180)
        async for r in call:
            if i % 2 and r.HasField("chunk"):
                call.cancel()  # the long half is cancelled after its first chunk
                return "cancelled"
        return "done"

    async def scenario() -> list[str]:
        async with grpc.aio.insecure_channel(address) as channel:
            stub = pb_grpc.InferenceServiceStub(channel)
            return await asyncio.gather(*(one(stub, i) for i in range(200)))

    try:
        results = asyncio.run(scenario())
        assert results.count("cancelled") == 100 and results.count("done") == 100
        deadline = time.monotonic() + 10
        while True:
            m = scrape(metrics)
            idle = (m["slora_requests_running"], m["slora_requests_waiting"],
                    m['slora_arena_pages{kind="kv"}']) == (0, 0, 0)
            if idle or time.monotonic() > deadline:
                break
            time.sleep(0.1)
        assert idle, m
        assert m["slora_requests_aborted_total"] == 100
    finally:
        worker.kill()
