"""One worker process on its own (no control plane needed for base-model calls): queue limit,
graceful drain on SIGTERM, error codes."""

from __future__ import annotations

import signal
import threading
import time
from pathlib import Path

import grpc
import pytest

from services.common.processes import free_port, is_serving, slora_argv, start_child, wait_serving
from services.worker.debug_hooks import STEP_DELAY_ENV
from slora.v1 import inference_pb2_grpc as pb_grpc
from tests.services.dataplane.dp_support import generate, request, scrape

pytestmark = pytest.mark.timeout(180)
# Long enough to still be running when SIGTERM arrives (4.5 s or more with the worker's 10 ms
# steps); within the demo model's 512-token context.
LONG = 450


def test_queue_limit_drain_and_error_codes(demo_dir: Path, tmp_path: Path) -> None:
    address, metrics = f"127.0.0.1:{free_port()}", free_port()
    worker = start_child("worker", slora_argv(
        "worker", "--model", str(demo_dir / "model"), "--control-plane",
        f"127.0.0.1:{free_port()}", "--listen", address, "--worker-id", "solo",
        "--max-num-seqs", "1", "--max-queue", "1", "--metrics-port", str(metrics),
        "--cache-dir", str(tmp_path / "cache"), "--drain-grace", "120"), tmp_path,
        # 10 ms steps (a test hook): the long request runs for seconds while the test looks.
        {STEP_DELAY_ENV: "0.01"})
    try:
        wait_serving(address, worker, timeout_s=120)
        long_req = request(max_new_tokens=LONG, ignore_eos=True, temperature=0)
        with grpc.insecure_channel(address) as channel:
            stream = pb_grpc.InferenceServiceStub(channel).Generate(long_req, timeout=120)
            first = next(stream)
            assert first.HasField("chunk")
            # One request runs, one may wait; the rest are refused with a retry hint.
            codes: list[grpc.StatusCode | None] = []
            threads = [threading.Thread(target=lambda: codes.append(
                generate(address, request(max_new_tokens=4)).error)) for _ in range(4)]
            for t in threads:
                t.start()
            deadline = time.monotonic() + 20
            while len(codes) < 3:  # the fourth waits behind the long request
                assert time.monotonic() < deadline, codes
                time.sleep(0.05)
            assert codes == [grpc.StatusCode.RESOURCE_EXHAUSTED] * 3, codes
            assert scrape(metrics)["slora_requests_waiting"] == 1
            # Codes for bad requests, decided in one place.
            assert generate(address, request(adapter="x")).error == grpc.StatusCode.INVALID_ARGUMENT
            assert generate(address, request(adapter="x", version="v1")).error == \
                grpc.StatusCode.NOT_FOUND
            assert generate(address, request(top_p=2.0)).error == grpc.StatusCode.INVALID_ARGUMENT
            # Request caps hold on the worker too (not only at the gateway).
            too_many_stops = request(stop=[f"s{i}" for i in range(1000)])
            assert generate(address, too_many_stops).error == grpc.StatusCode.INVALID_ARGUMENT
            assert scrape(metrics)["slora_requests_running"] == 1
            # SIGTERM: NOT_SERVING at once, new calls refused, the running stream completes.
            worker.popen.send_signal(signal.SIGTERM)
            deadline = time.monotonic() + 10
            while is_serving(address):
                assert time.monotonic() < deadline
                time.sleep(0.05)
            refused = generate(address, request(max_new_tokens=2))
            assert refused.error == grpc.StatusCode.UNAVAILABLE, refused
            rest = list(stream)
            for t in threads:
                t.join()
            assert codes[3] is None  # the waiting request was served during the drain
        assert rest[-1].complete.finish_reason == "length"
        # The first chunk may carry several tokens (a stream behind the core gets them merged).
        got = len(first.chunk.token_ids) + sum(len(r.chunk.token_ids) for r in rest[:-1])
        assert got == LONG
        assert worker.popen.wait(30) == 0
    finally:
        worker.kill()
