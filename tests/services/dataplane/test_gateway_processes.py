"""A gateway of two processes on the same ports (`slora gateway --processes 2`), in a real
stack on loopback: both processes serve, the canary split and the evidence agree across them,
feedback reaches the process that served the request, and a dead process takes the gateway
down with a nonzero exit.

Every call opens its own connection (the kernel picks a process per connection), so a few
dozen calls reach both processes with near certainty. The tests run in file order; the last
breaks the gateway on purpose."""

from __future__ import annotations

import os
import signal
import socket
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from pathlib import Path

import grpc
import httpx
import pytest

from devtools.demo_stack import Stack, StackConfig, publish_demo_adapters, wait_until_routable
from services.commands.gateway import PROCESSES_ENV
from services.common.processes import free_port, slora_argv, start_child
from services.control_plane.api.client import AdminClient
from services.gateway.main import GatewayOptions
from services.gateway.supervisor import child_options
from services.gateway.table import canary_share
from slora.v1 import inference_pb2 as pb
from slora.v1 import inference_pb2_grpc as pb_grpc
from slora_core.adapters import digest_adapter_dir
from tests.services.dataplane.dp_support import request, scrape

ADAPTERS = ("qv-r4", "attn-r8")
COUNTED = "attn-r8"  # no call before the tests: its evidence is theirs alone
pytestmark = pytest.mark.timeout(300)
# A channel of its own subchannel pool: a new connection, not one shared with other channels.
FRESH = (("grpc.use_local_subchannel_pool", 1),)


class Running:
    def __init__(self, stack: Stack, admin: AdminClient, token: str, metrics_ports: list[int]):
        self.stack, self.admin, self.token = stack, admin, token
        self.metrics_ports = metrics_ports
        self.address = stack.gateway_addresses["gw"]

    def call(self, req: pb.GenerateRequest) -> pb.Complete:
        """One call on a new connection; its `complete`."""
        md = (("authorization", f"Bearer {self.token}"),)
        with grpc.insecure_channel(self.address, options=FRESH) as channel:
            out = list(pb_grpc.InferenceServiceStub(channel).Generate(req, metadata=md,
                                                                      timeout=60))
        return out[-1].complete

    def feedback(self, request_id: str, score: float) -> grpc.StatusCode:
        md = (("authorization", f"Bearer {self.token}"),)
        with grpc.insecure_channel(self.address, options=FRESH) as channel:
            try:
                pb_grpc.InferenceServiceStub(channel).ReportFeedback(
                    pb.ReportFeedbackRequest(request_id=request_id, score=score), metadata=md,
                    timeout=30)
            except grpc.RpcError as exc:
                return exc.code()
        return grpc.StatusCode.OK

    def requests_per_process(self) -> list[float]:
        return [scrape(p).get("slora_gateway_requests_total", 0.0) for p in self.metrics_ports]

    def routed(self, adapter: str) -> dict[str, tuple[int, int]]:
        """version -> (routed, feedback_count) as the control plane totals them."""
        return {f.version: (f.total.routed, f.total.feedback_count)
                for f in self.admin.status(adapter).figures}


def two_free_ports() -> int:
    """A port P with P and P+1 free a moment ago (one metrics port per process)."""
    for _ in range(100):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = int(s.getsockname()[1])
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port + 1))
            except OSError:
                continue
        return port
    raise RuntimeError("no two consecutive free ports")


@pytest.fixture(scope="module")
def running(demo_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Running]:
    stack = Stack(StackConfig(demo_dir=demo_dir, state_dir=tmp_path_factory.mktemp("stack"),
                              heartbeat_s=0.5))
    metrics = two_free_ports()
    try:
        stack.start_control_plane()
        stack.start_worker("w1", wait=False)
        # A short drain grace: the dead-process test waits for the survivors to drain.
        stack.start_gateway("gw", wait=False, processes=2,
                            extra=("--metrics-port", str(metrics), "--drain-grace", "5"))
        admin = AdminClient.connect(stack.cp_address, stack.admin_token)
        token = publish_demo_adapters(admin, demo_dir, ADAPTERS)
        run = Running(stack, admin, token, [metrics, metrics + 1])
        wait_until_routable(run.address, token, ["qv-r4"], timeout_s=120)
        ok = 0  # the key reaches each process with its own registry poll
        while ok < 10:
            try:
                run.call(request(adapter="qv-r4", max_new_tokens=1))
                ok += 1
            except grpc.RpcError:
                ok = 0
                time.sleep(0.1)
        yield run
    finally:
        stack.stop()


def test_both_processes_serve_and_their_evidence_adds_up(running: Running) -> None:
    before = running.requests_per_process()
    grpc_calls, http_calls = 24, 8
    with ThreadPoolExecutor(8) as pool:
        list(pool.map(lambda _: running.call(request(adapter=COUNTED, max_new_tokens=2)),
                      range(grpc_calls)))
    base = running.stack.http_urls["gw"]
    for _ in range(http_calls):  # a client each: a connection each
        with httpx.Client(base_url=base, timeout=60,
                          headers={"authorization": f"Bearer {running.token}"}) as client:
            r = client.post("/completions", json={"model": COUNTED, "prompt": "Hi",
                                                  "max_tokens": 2})
            assert r.status_code == 200, r.text
    served = [a - b for a, b in zip(running.requests_per_process(), before, strict=True)]
    assert all(n > 0 for n in served), served
    assert sum(served) == grpc_calls + http_calls
    # Each process reports its own deltas on its own stream; the control plane adds them.
    deadline = time.monotonic() + 10
    while running.routed(COUNTED).get("v1", (0, 0))[0] < grpc_calls + http_calls:
        assert time.monotonic() < deadline, running.routed(COUNTED)
        time.sleep(0.2)
    time.sleep(1.5)  # a later report would show a double count
    assert running.routed(COUNTED)["v1"][0] == grpc_calls + http_calls


def test_canary_split_is_the_same_in_both_processes(running: Running, demo_dir: Path) -> None:
    admin = running.admin
    v2 = demo_dir / "adapters" / "attn-r8"
    admin.register("qv-r4", "v2", v2.resolve().as_uri(), digest_adapter_dir(v2), "demo", "demo")
    admin.canary("qv-r4", "v2", 0.5)
    keys = [f"user-{i}" for i in range(40)]
    expect = {k: "v2" if canary_share("qv-r4", k) < 0.5 else "v1" for k in keys}
    canary_key = next(k for k, v in expect.items() if v == "v2")

    def version_of(key: str) -> str:
        return running.call(request(adapter="qv-r4", routing_key=key,
                                    max_new_tokens=1)).served_by.adapter_version

    ok, deadline = 0, time.monotonic() + 10
    while ok < 10:  # the canary reached both processes
        ok = ok + 1 if version_of(canary_key) == "v2" else 0
        assert time.monotonic() < deadline
    before = running.requests_per_process()
    with ThreadPoolExecutor(8) as pool:
        first = dict(zip(keys, pool.map(version_of, keys), strict=True))
        again = dict(zip(keys, pool.map(version_of, keys), strict=True))
    served = [a - b for a, b in zip(running.requests_per_process(), before, strict=True)]
    assert all(n > 0 for n in served), served
    assert first == expect
    assert again == expect


def test_feedback_reaches_the_process_that_served(running: Running) -> None:
    before = running.routed(COUNTED).get("v1", (0, 0))[1]
    ids = [running.call(request(adapter=COUNTED, max_new_tokens=1)).request_id
           for _ in range(12)]
    # Each on a new connection: about half land on the process that did not serve the request.
    assert [running.feedback(rid, 0.5) for rid in ids] == [grpc.StatusCode.OK] * len(ids)
    assert {running.feedback(ids[0], 1.0) for _ in range(6)} == {
        grpc.StatusCode.ALREADY_EXISTS}
    assert running.feedback("never-served", 1.0) == grpc.StatusCode.NOT_FOUND
    deadline = time.monotonic() + 10
    while running.routed(COUNTED)["v1"][1] < before + len(ids):
        assert time.monotonic() < deadline, running.routed(COUNTED)
        time.sleep(0.2)


def gateway_processes(parent_pid: int) -> list[int]:
    """The gateway's serving children (not multiprocessing's resource tracker)."""
    found = []
    children = Path(f"/proc/{parent_pid}/task/{parent_pid}/children").read_text().split()
    for pid in map(int, children):
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
        if b"resource_tracker" not in cmdline:
            found.append(pid)
    return found


def test_child_options_give_each_process_its_identity(tmp_path: Path) -> None:
    opts = GatewayOptions(control_plane="cp:1", listen="127.0.0.1:5000", gateway_id="gw",
                          metrics_port=9100)
    kids = [child_options(opts, i, 3, tmp_path) for i in range(3)]
    assert [k.gateway_id for k in kids] == ["gw-p0", "gw-p1", "gw-p2"]
    assert [k.metrics_port for k in kids] == [9100, 9101, 9102]
    assert all(k.shared_ports and k.listen == opts.listen for k in kids)
    assert kids[1].sibling_sockets == (kids[0].own_socket, kids[2].own_socket)
    assert child_options(replace(opts, metrics_port=None), 1, 2, tmp_path).metrics_port is None


def test_sigterm_drains_every_process_and_exits_0(tmp_path: Path) -> None:
    """Processes from the environment variable; none ever reaches a control plane."""
    child = start_child("gateway", slora_argv(
        "gateway", "--control-plane", f"127.0.0.1:{free_port()}", "--listen", "127.0.0.1:0",
        "--http-listen", "127.0.0.1:0", "--drain-grace", "5"), tmp_path,
        {PROCESSES_ENV: "2"})
    deadline = time.monotonic() + 60
    while child.log_tail().count("waiting for the routing table") < 2:
        assert child.alive and time.monotonic() < deadline, child.log_tail()
        time.sleep(0.1)
    assert child.stop(timeout_s=30) == 0, child.log_tail()


def test_a_dead_process_takes_the_gateway_down(running: Running) -> None:
    parent = running.stack.gateways["gw"]
    children = gateway_processes(parent.popen.pid)
    assert len(children) == 2
    os.kill(children[0], signal.SIGKILL)
    assert parent.popen.wait(timeout=60) == 1
    # The survivors are gone too (once init has reaped them: orphaned, a zombie's /proc entry
    # lingers a moment after the parent exits).
    deadline = time.monotonic() + 10
    while any(Path(f"/proc/{pid}").exists() for pid in children[1:]):
        assert time.monotonic() < deadline, "a gateway process outlived the gateway"
        time.sleep(0.05)
    assert "exited with -9; stopping the others" in parent.log_tail()
