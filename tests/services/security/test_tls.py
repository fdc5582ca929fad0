"""TLS on every hop (services.common.tls): the local stack with a throwaway CA serves Generate
(gRPC) and the OpenAI-compatible HTTP API through the gateway to clients that trust the CA,
while plaintext clients of the control plane, gateway (gRPC and HTTP) and worker are refused;
certificate files and the env setting."""

from __future__ import annotations

import ssl
import stat
from collections.abc import Iterator
from pathlib import Path

import grpc
import httpx
import pytest
from cryptography import x509
from grpc_health.v1 import health_pb2, health_pb2_grpc

from devtools.demo_stack import (
    Stack,
    StackConfig,
    publish_demo_adapters,
    wait_until_routable,
)
from services.common.processes import wait_serving
from services.common.tls import CA_ENV, CERT_ENV, KEY_ENV, TlsConfig, write_throwaway_certs
from services.control_plane.api.client import AdminClient
from slora.v1 import inference_pb2 as pb
from slora.v1 import inference_pb2_grpc as pb_grpc

pytestmark = pytest.mark.timeout(300)


def test_throwaway_certs(tmp_path: Path) -> None:
    files = write_throwaway_certs(tmp_path / "tls")
    assert files.cert and files.key and files.ca
    assert stat.S_IMODE(files.key.stat().st_mode) == 0o600
    ca = x509.load_pem_x509_certificate(files.ca.read_bytes())
    leaf = x509.load_pem_x509_certificate(files.cert.read_bytes())
    leaf.verify_directly_issued_by(ca)  # raises unless the CA signed it
    names = leaf.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert "localhost" in names.get_values_for_type(x509.DNSName)
    assert TlsConfig.from_env({}) is None
    assert TlsConfig.from_env({CA_ENV: str(files.ca)}) == TlsConfig(ca=files.ca)
    with pytest.raises(ValueError):
        TlsConfig.from_env({CERT_ENV: str(files.cert)})


@pytest.fixture(scope="module")
def tls_stack(demo_dir: Path, tmp_path_factory: pytest.TempPathFactory
              ) -> Iterator[tuple[Stack, str]]:
    stack = Stack(StackConfig(demo_dir=demo_dir, state_dir=tmp_path_factory.mktemp("tls"),
                              tls=True))
    _ = stack.env  # writes the certificates
    assert stack.tls_files is not None
    with pytest.MonkeyPatch.context() as mp:
        # This process is a client of the stack: it trusts the throwaway CA.
        mp.setenv(CA_ENV, str(stack.tls_files.ca))
        for name in (CERT_ENV, KEY_ENV):
            mp.delenv(name, raising=False)
        try:
            stack.start_control_plane()
            stack.start_worker("w1", wait=False)
            stack.start_gateway("g1", wait=False)
            token = publish_demo_adapters(
                AdminClient.connect(stack.cp_address, stack.admin_token), demo_dir, ["qv-r4"])
            wait_serving(stack.worker_addresses["w1"], stack.workers["w1"], timeout_s=120)
            wait_serving(stack.gateway_addresses["g1"], stack.gateways["g1"])
            wait_until_routable(stack.gateway_addresses["g1"], token, ["qv-r4"])
            yield stack, token
        finally:
            stack.stop()


def test_generate_over_tls(tls_stack: tuple[Stack, str]) -> None:
    stack, token = tls_stack
    assert stack.tls_files is not None and stack.tls_files.ca is not None
    credentials = grpc.ssl_channel_credentials(stack.tls_files.ca.read_bytes())
    with grpc.secure_channel(stack.gateway_addresses["g1"], credentials) as channel:
        replies = list(pb_grpc.InferenceServiceStub(channel).Generate(
            pb.GenerateRequest(text="Hello", adapter=pb.AdapterRef(adapter_id="qv-r4"),
                               sampling=pb.SamplingOptions(max_new_tokens=3, temperature=0)),
            metadata=(("authorization", f"Bearer {token}"),), timeout=60))
    assert replies[-1].complete.usage.completion_tokens == 3
    assert replies[-1].complete.served_by.worker_id == "w1"


def test_http_api_over_tls(tls_stack: tuple[Stack, str]) -> None:
    stack, token = tls_stack
    assert stack.tls_files is not None
    url = stack.http_urls["g1"]
    assert url.startswith("https://")
    headers = {"Authorization": f"Bearer {token}"}
    trust = ssl.create_default_context(cafile=str(stack.tls_files.ca))
    models = httpx.get(f"{url}/models", headers=headers, verify=trust)
    assert models.status_code == 200 and "qv-r4" in models.text
    with pytest.raises(httpx.HTTPError):  # plaintext HTTP to the TLS port
        httpx.get(url.replace("https://", "http://") + "/models", headers=headers, timeout=5)
    with pytest.raises(httpx.HTTPError):  # a client that does not trust the throwaway CA
        httpx.get(f"{url}/models", headers=headers, timeout=5)


def test_plaintext_clients_are_refused(tls_stack: tuple[Stack, str]) -> None:
    stack, _ = tls_stack
    targets = [stack.cp_address, stack.gateway_addresses["g1"], stack.worker_addresses["w1"]]
    for target in targets:
        with grpc.insecure_channel(target) as channel, pytest.raises(grpc.RpcError) as refused:
            health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(service=""), timeout=3)
        assert refused.value.code() == grpc.StatusCode.UNAVAILABLE, target
