"""Safe rollout with real processes on loopback: a control plane (SQLite, analyzer ticking every
0.1 s), one worker and one gateway, client traffic through the gateway's public API.

Each test gives one demo adapter a canary under a short-window policy while traffic runs, and
reads what happened from the admin API and the audit log: a canary whose files fail to load on
the worker, a slow one (the worker's SLORA_DEBUG_SLOW_VERSIONS hook) and one with bad client
feedback are rolled back; a healthy one climbs its steps and is promoted, including across a
control-plane restart in the middle of a window."""

from __future__ import annotations

import json
import shutil
import subprocess
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import grpc
import pytest

from devtools.demo_stack import (
    Stack,
    StackConfig,
    publish_demo_adapters,
    wait_until_routable,
)
from services.common.processes import free_port, slora_argv
from services.control_plane.api.client import AdminClient
from slora.v1 import admin_pb2 as apb
from slora.v1 import inference_pb2 as pb
from slora.v1 import inference_pb2_grpc as pb_grpc
from slora_core.adapters import digest_adapter_dir
from tests.services.dataplane.dp_support import PROMPTS, scrape

ADAPTERS = ("qv-r4", "attn-r8", "all-r16", "mlp-r32")
SLOW = ("attn-r8", "v2")
ANALYZER = "system:canary-analyzer"
pytestmark = pytest.mark.timeout(240)


@dataclass
class Running:
    stack: Stack
    admin: AdminClient
    token: str
    metrics_port: int

    @property
    def gateway(self) -> str:
        return self.stack.gateway_addresses["g1"]

    def upload(self, name: str, source: str) -> Path:
        """A copy of demo adapter `source`'s files, registrable from the uploads root."""
        path = self.stack.config.state_dir / "uploads" / name
        shutil.copytree(self.stack.config.demo_dir / "adapters" / source, path)
        return path

    def register(self, adapter: str, version: str, path: Path) -> None:
        self.admin.register(adapter, version, path.as_uri(), digest_adapter_dir(path), "demo",
                            "demo")


@pytest.fixture(scope="module")
def running(demo_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Running]:
    state = tmp_path_factory.mktemp("rollout")
    (state / "uploads").mkdir()
    metrics_port = free_port()
    stack = Stack(StackConfig(
        demo_dir=demo_dir, state_dir=state, heartbeat_s=0.5, extra_roots=(state / "uploads",),
        control_plane_args=("--analyzer-tick", "0.1", "--metrics-port", str(metrics_port))))
    try:
        stack.start_control_plane()
        stack.start_worker("w1", wait=False,
                           env={"SLORA_DEBUG_SLOW_VERSIONS": f"{SLOW[0]}@{SLOW[1]}=0.1"})
        stack.start_gateway("g1", wait=False)
        admin = AdminClient.connect(stack.cp_address, stack.admin_token)
        token = publish_demo_adapters(admin, demo_dir, ADAPTERS)
        for address in stack.gateway_addresses.values():
            wait_until_routable(address, token, ADAPTERS, timeout_s=120)
        yield Running(stack, admin, token, metrics_port)
    finally:
        stack.stop()


@dataclass
class Call:
    request_id: str
    started: float = 0.0  # time.monotonic()
    version: str = ""
    is_fallback: bool = False
    error: grpc.StatusCode | None = None
    details: str = ""


class Traffic:
    """Calls to one adapter from a few threads, each with a fresh routing key, until stopped.
    `feedback(call)` may return a score to report for the call."""

    def __init__(self, running: Running, adapter: str, threads: int = 4,
                 feedback: Callable[[Call], float | None] | None = None) -> None:
        self.running, self.adapter, self.feedback = running, adapter, feedback
        self.calls: list[Call] = []
        self._stop = threading.Event()
        self._threads = [threading.Thread(target=self._loop, args=(i,)) for i in range(threads)]

    def _loop(self, i: int) -> None:
        md = (("authorization", f"Bearer {self.running.token}"),)
        with grpc.insecure_channel(self.running.gateway) as channel:
            stub = pb_grpc.InferenceServiceStub(channel)
            n = 0
            while not self._stop.is_set():
                call = self._one(stub, md, PROMPTS[(i + n) % len(PROMPTS)])
                self.calls.append(call)
                n += 1
                score = self.feedback(call) if self.feedback and call.error is None else None
                if score is not None:
                    stub.ReportFeedback(pb.ReportFeedbackRequest(
                        request_id=call.request_id, score=score,
                        labels={"thumb": "up" if score > 0 else "down"}), metadata=md, timeout=10)

    def _one(self, stub: pb_grpc.InferenceServiceStub, md: tuple, prompt: str) -> Call:
        call = Call(uuid.uuid4().hex, time.monotonic())
        req = pb.GenerateRequest(
            request_id=call.request_id, text=prompt, routing_key=uuid.uuid4().hex,
            adapter=pb.AdapterRef(adapter_id=self.adapter),
            sampling=pb.SamplingOptions(max_new_tokens=4, temperature=0, ignore_eos=True))
        try:
            for r in stub.Generate(req, metadata=md, timeout=30):
                if r.HasField("complete"):
                    assert r.complete.request_id == call.request_id
                    call.version = r.complete.served_by.adapter_version
                    call.is_fallback = r.complete.served_by.is_fallback
        except grpc.RpcError as e:
            call.error, call.details = e.code(), e.details() or ""
        return call

    def __enter__(self) -> Traffic:
        for t in self._threads:
            t.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        for t in self._threads:
            t.join()

    def failed(self) -> list[Call]:
        return [c for c in self.calls if c.error is not None]


def policy(**kwargs: object) -> apb.CanaryPolicy:
    return apb.CanaryPolicy(**{"window_seconds": 2.0, "min_requests": 5, **kwargs})


def wait_for(predicate: Callable[[], bool], timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


def analyzer_events(running: Running, adapter: str) -> list[apb.AuditEvent]:
    return [e for e in running.admin.events(adapter) if e.actor == ANALYZER]


def canary_rolled_back(running: Running, adapter: str) -> apb.AuditEvent:
    """Wait for the analyzer's rollback of `adapter`'s canary and return its event."""
    wait_for(lambda: not running.admin.get(adapter).route.canary_version, 20, "a rollback")
    [event] = analyzer_events(running, adapter)
    assert event.action == "rollback"
    return event


def analysis(event: apb.AuditEvent) -> dict:
    return json.loads(event.details_json)["analysis"]


def seconds_between(a: apb.AuditEvent, b: apb.AuditEvent) -> float:
    return (b.at.ToDatetime() - a.at.ToDatetime()).total_seconds()


def test_canary_that_cannot_load_is_rolled_back_within_a_window_without_failed_calls(
        running: Running) -> None:
    admin = running.admin
    path = running.upload("qv-r4-v2", "all-r16")
    running.register("qv-r4", "v2", path)
    # The stored copy changes after registration: the worker's sha256 check refuses it.
    config = path / "adapter_config.json"
    config.write_text(config.read_text().replace('"lora_alpha": 16', '"lora_alpha": 17'))
    admin.set_policy("qv-r4", policy(max_error_rate_increase=0.2, steps=[0.5]))
    with Traffic(running, "qv-r4") as traffic:
        admin.canary("qv-r4", "v2", 0.3)
        event = canary_rolled_back(running, "qv-r4")
        seen_at = time.monotonic()
        time.sleep(2 * 2.0 + 0.5)  # two more windows of traffic: nothing brings v2 back
    started = next(e for e in admin.events("qv-r4") if e.action == "canary")
    assert seconds_between(started, event) <= 2.0
    assert traffic.failed() == []
    fallbacks = [c for c in traffic.calls if c.is_fallback]
    assert fallbacks and all(c.version == "v1" for c in traffic.calls)
    # The gateway has the new route within its poll interval: later calls go to v1 directly.
    assert not any(c.is_fallback for c in traffic.calls if c.started > seen_at + 1.0)
    found = analysis(event)
    assert found["crossed"] == ["failure_rate_increase"]
    # Decided on whichever side reported first (worker errors or gateway fallbacks); calls
    # still in flight count as requests but not yet as failures.
    assert found["canary"]["failure_rate"] > 0.2
    assert set(found["canary"]["errors_by_code"]) <= {"INVALID_ARGUMENT"}
    totals = {f.version: f.total for f in admin.status("qv-r4").figures}
    assert totals["v2"].failure_rate == 1.0  # settled: every call to v2 failed and fell back
    assert totals["v2"].fallbacks == totals["v2"].routed > 0
    assert dict(totals["v2"].errors_by_code) == {"INVALID_ARGUMENT": totals["v2"].requests}
    info = admin.get("qv-r4")
    assert {v.version: v.state for v in info.versions}["v2"] == apb.VERSION_STATE_ROLLED_BACK
    assert len(analyzer_events(running, "qv-r4")) == 1


def test_slow_canary_is_rolled_back_on_latency(running: Running) -> None:
    running.register(*SLOW, running.upload("attn-r8-v2", "attn-r12"))
    running.admin.set_policy(SLOW[0], policy(max_ttft_ratio=1.5, max_tpot_ratio=1.5))
    with Traffic(running, SLOW[0]) as traffic:
        running.admin.canary(*SLOW, 0.3)
        event = canary_rolled_back(running, SLOW[0])
    assert traffic.failed() == []
    found = analysis(event)
    assert found["crossed"] and set(found["crossed"]) <= {"ttft_ratio", "tpot_ratio"}
    assert found["canary"]["failures"] == 0
    assert found["canary"]["ttft_mean_s"] > 0.1  # the hook's delay comes before each chunk


def test_canary_with_poor_feedback_is_rolled_back(running: Running) -> None:
    admin = running.admin
    running.register("all-r16", "v2", running.upload("all-r16-v2", "mlp-r32"))
    admin.set_policy("all-r16", policy(max_feedback_drop=0.5, min_feedback=5))

    def score(call: Call) -> float:
        return -1.0 if call.version == "v2" else 1.0

    with Traffic(running, "all-r16", feedback=score) as traffic:
        admin.canary("all-r16", "v2", 0.3)
        event = canary_rolled_back(running, "all-r16")
    assert traffic.failed() == []
    found = analysis(event)
    assert found["crossed"] == ["feedback_drop"]
    assert (found["canary"]["feedback_mean"], found["stable"]["feedback_mean"]) == (-1.0, 1.0)
    totals = {f.version: f.total for f in admin.status("all-r16").figures}
    assert totals["v2"].feedback_labels["thumb=down"] == totals["v2"].feedback_count > 0


def test_feedback_errors(running: Running) -> None:
    md = (("authorization", f"Bearer {running.token}"),)
    with grpc.insecure_channel(running.gateway) as channel:
        stub = pb_grpc.InferenceServiceStub(channel)
        done = list(stub.Generate(pb.GenerateRequest(
            text="Hi", sampling=pb.SamplingOptions(max_new_tokens=1)), metadata=md, timeout=30))
        request_id = done[-1].complete.request_id
        assert request_id  # made up by the gateway, returned for feedback

        def code(req: pb.ReportFeedbackRequest, metadata: tuple = md) -> grpc.StatusCode:
            try:
                stub.ReportFeedback(req, metadata=metadata, timeout=10)
            except grpc.RpcError as e:
                return e.code()
            return grpc.StatusCode.OK

        ok = pb.ReportFeedbackRequest(request_id=request_id, score=0.5)
        assert code(ok, ()) == grpc.StatusCode.UNAUTHENTICATED
        assert code(pb.ReportFeedbackRequest(request_id=request_id, score=1.5)) == \
            grpc.StatusCode.INVALID_ARGUMENT
        assert code(pb.ReportFeedbackRequest(request_id="nope", score=1)) == \
            grpc.StatusCode.NOT_FOUND
        assert code(ok) == grpc.StatusCode.OK
        assert code(ok) == grpc.StatusCode.ALREADY_EXISTS


@pytest.mark.slow  # every canary step and a restart; the rollback e2e stays default
def test_healthy_canary_walks_its_steps_across_a_restart_and_is_promoted(
        running: Running) -> None:
    admin, stack = running.admin, running.stack
    running.register("mlp-r32", "v2", running.upload("mlp-r32-v2", "qdown-r20"))
    admin.set_policy("mlp-r32", policy(window_seconds=3.0, max_error_rate_increase=0.1,
                                       max_ttft_ratio=5.0, steps=[0.2, 0.5]))
    with Traffic(running, "mlp-r32") as traffic:
        admin.canary("mlp-r32", "v2", 0.2)
        wait_for(lambda: admin.get("mlp-r32").route.traffic_ratio == 0.5, 20, "the 2nd step")
        time.sleep(1.0)  # in the middle of the second window: restart the control plane
        status = admin.status("mlp-r32")
        assert status.analysis.windows_passed == 1 and status.analysis.last_decision == "advance"
        stack.control_plane.stop()
        stack.start_control_plane()
        admin = AdminClient.connect(stack.cp_address, stack.admin_token)
        wait_for(lambda: admin.get("mlp-r32").route.stable_version == "v2", 30, "promotion")
        cli = subprocess.run(
            slora_argv("admin", "--target", stack.cp_address, "--key", stack.admin_token,
                       "status", "mlp-r32"), capture_output=True, text=True, timeout=60)
        # The restarted control plane counts v2's requests from the evidence that reaches it
        # after its start (the slow set on two xdist workers scraped 0 right at the promotion).
        v2 = 'slora_version_requests_total{adapter_id="mlp-r32",version="v2"}'
        wait_for(lambda: scrape(running.metrics_port).get(v2, 0) > 0, 20, "v2's requests counted")
        metrics = scrape(running.metrics_port)
    assert traffic.failed() == [], traffic.failed()[:3]
    events = analyzer_events(running, "mlp-r32")
    assert [e.action for e in events] == ["canary", "promote"]
    assert analysis(events[1])["windows_passed"] == 1
    info = admin.get("mlp-r32")
    assert (info.route.stable_version, info.route.canary_version, info.route.fallback_version) == (
        "v2", "", "v1")
    assert cli.returncode == 0, cli.stderr
    assert "last decision: promote v2" in cli.stdout and "stable v2" in cli.stdout
    assert metrics[v2] > 0
    assert metrics['slora_canary_decisions_total{adapter_id="mlp-r32",decision="promote"}'] == 1
