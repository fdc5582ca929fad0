"""The local stack (`slora up`'s Stack) against issue 14's direct-call and secret-spreading
attacks: a client calling a worker directly with a valid tenant key gets UNAUTHENTICATED (the
same call through the gateway works); each child holds only its role's secrets; metrics of a
loopback stack listen on loopback only."""

from __future__ import annotations

from pathlib import Path

import grpc
import pytest

from devtools.demo_stack import Stack
from slora.v1 import inference_pb2 as pb
from slora.v1 import inference_pb2_grpc as pb_grpc
from tests.services.dataplane.http_support import HttpStack

# The shared HTTP stack (tests/services/conftest.py): workers w1, gateway g1, qv-r4 published.
pytestmark = pytest.mark.timeout(300)
ADAPTER = "qv-r4"


@pytest.fixture(scope="module")
def stack(shared_http_stack: HttpStack) -> tuple[Stack, str, int]:
    hs = shared_http_stack
    return hs.stack, hs.token, hs.worker_metrics


def _generate(address: str, token: str) -> grpc.StatusCode:
    request = pb.GenerateRequest(text="Hello", adapter=pb.AdapterRef(adapter_id=ADAPTER),
                                 sampling=pb.SamplingOptions(max_new_tokens=1, temperature=0))
    with grpc.insecure_channel(address) as channel:
        try:
            list(pb_grpc.InferenceServiceStub(channel).Generate(
                request, metadata=(("authorization", f"Bearer {token}"),), timeout=60))
            return grpc.StatusCode.OK
        except grpc.RpcError as exc:
            return exc.code()  # type: ignore[no-any-return]


def test_workers_refuse_direct_calls(stack: tuple[Stack, str, int]) -> None:
    s, token, _ = stack
    assert _generate(s.worker_addresses["w1"], token) == grpc.StatusCode.UNAUTHENTICATED
    assert _generate(s.worker_addresses["w1"], "") == grpc.StatusCode.UNAUTHENTICATED
    # Through the gateway the same call is served (retrying while the route propagates).
    for _ in range(100):
        if _generate(s.gateway_addresses["g1"], token) == grpc.StatusCode.OK:
            break
    assert _generate(s.gateway_addresses["g1"], token) == grpc.StatusCode.OK


def _environ(pid: int) -> dict[str, str]:
    raw = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    return dict(item.decode(errors="replace").partition("=")[::2] for item in raw if item)


def test_each_child_holds_only_its_secrets(stack: tuple[Stack, str, int]) -> None:
    s, _, _ = stack
    assert s.control_plane is not None
    secrets = {"SLORA_ADMIN_KEY": s.admin_token, "SLORA_CLUSTER_TOKEN": s.cluster_token,
               "SLORA_GATEWAY_TOKEN": s.gateway_token}
    expected = [(s.control_plane, {"SLORA_ADMIN_KEY", "SLORA_CLUSTER_TOKEN"}),
                (s.gateways["g1"], {"SLORA_CLUSTER_TOKEN", "SLORA_GATEWAY_TOKEN"}),
                (s.workers["w1"], {"SLORA_GATEWAY_TOKEN", "SLORA_WORKER_CREDENTIAL"})]
    for child, names in expected:
        env = _environ(child.popen.pid)
        held = {n for n, v in secrets.items() if env.get(n) == v}
        if env.get("SLORA_WORKER_CREDENTIAL", "").startswith("slw_"):
            held.add("SLORA_WORKER_CREDENTIAL")
        assert held == names, child.name


def _listening(port: int) -> set[str]:
    """Local addresses (hex, as in /proc/net/tcp) listening on `port`."""
    found = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in Path(table).read_text().splitlines()[1:]:
            local, state = line.split()[1], line.split()[3]
            address, _, hex_port = local.partition(":")
            if state == "0A" and int(hex_port, 16) == port:
                found.add(address)
    return found


def test_metrics_follow_the_listen_host(stack: tuple[Stack, str, int]) -> None:
    _, _, metrics_port = stack
    assert _listening(metrics_port) == {"0100007F"}  # 127.0.0.1 only
