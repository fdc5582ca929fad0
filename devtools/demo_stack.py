"""A whole local stack in child processes: control plane (SQLite or PostgreSQL), workers and
gateways on loopback, with the demo adapters published. Used by `slora up` and the tests."""

from __future__ import annotations

import secrets
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import grpc

from services.common.cluster_token import CLUSTER_TOKEN_ENV, new_cluster_token
from services.common.hop_auth import GATEWAY_TOKEN_ENV, new_gateway_token
from services.common.identity import WORKER_CREDENTIAL_ENV
from services.common.processes import (
    Child,
    free_port,
    slora_argv,
    start_child,
    stop_all,
    wait_serving,
)
from services.common.tls import (
    CA_ENV,
    CERT_ENV,
    KEY_ENV,
    TlsConfig,
    open_sync_channel,
    write_throwaway_certs,
)
from services.control_plane.api.client import AdminClient
from services.control_plane.store.worker_credentials import mint_with_database
from slora.v1 import admin_pb2 as apb
from slora_core.adapters import digest_adapter_dir

BASE_MODEL = "demo"
TENANT = "demo"
VERSION = "v1"


@dataclass
class StackConfig:
    demo_dir: Path               # model/, adapters/<name>/ (slora demo-assets)
    state_dir: Path              # logs, database, disk caches
    db_url: str = ""             # default: SQLite under state_dir
    host: str = "127.0.0.1"
    heartbeat_s: float = 1.0
    extra_roots: tuple[Path, ...] = ()  # more folders file:// adapter URIs may come from
    worker_args: tuple[str, ...] = ("--num-pages", "128", "--max-num-seqs", "16")
    control_plane_args: tuple[str, ...] = ()  # e.g. --metrics-port, --analyzer-tick
    tls: bool = False  # a throwaway CA and certificate; every gRPC hop then runs TLS


@dataclass
class Stack:
    config: StackConfig
    admin_token: str = field(default_factory=lambda: "slk_admin_" + secrets.token_urlsafe(24))
    cluster_token: str = field(default_factory=new_cluster_token)
    gateway_token: str = field(default_factory=new_gateway_token)
    tls_files: TlsConfig | None = None  # written at first use when config.tls
    control_plane: Child | None = None
    cp_address: str = ""
    workers: dict[str, Child] = field(default_factory=dict)
    worker_addresses: dict[str, str] = field(default_factory=dict)
    gateways: dict[str, Child] = field(default_factory=dict)
    gateway_addresses: dict[str, str] = field(default_factory=dict)
    http_urls: dict[str, str] = field(default_factory=dict)  # gateway -> OpenAI API base URL

    @property
    def env(self) -> dict[str, str]:
        """What every child gets; no secrets (those come from `env_for`) but the TLS files."""
        env = {"SLORA_HEARTBEAT_S": str(self.config.heartbeat_s), "PYTHONUNBUFFERED": "1"}
        if self.config.tls:
            if self.tls_files is None:
                self.tls_files = write_throwaway_certs(self.config.state_dir / "tls")
            files = self.tls_files
            env.update({CERT_ENV: str(files.cert), KEY_ENV: str(files.key), CA_ENV: str(files.ca)})
        return env

    def env_for(self, role: str) -> dict[str, str]:
        """`env` plus only the secrets `role` needs (docs/security.md): the control plane the
        admin key and the cluster token, a gateway the cluster and gateway tokens, a worker
        the gateway token (and its own credential, added by start_worker)."""
        # Secrets go by environment, not argv: arguments show in `ps`.
        needs = {"control-plane": {"SLORA_ADMIN_KEY": self.admin_token,
                                   CLUSTER_TOKEN_ENV: self.cluster_token},
                 "gateway": {CLUSTER_TOKEN_ENV: self.cluster_token,
                             GATEWAY_TOKEN_ENV: self.gateway_token},
                 "worker": {GATEWAY_TOKEN_ENV: self.gateway_token}}
        return {**self.env, **needs[role]}

    def client_ca(self) -> Path:
        """The CA a client of this TLS stack must trust (written at first use)."""
        if not self.config.tls:
            raise ValueError("this stack runs without TLS")
        _ = self.env  # writes the certificates
        assert self.tls_files is not None and self.tls_files.ca is not None
        return self.tls_files.ca

    @property
    def db_url(self) -> str:
        return self.config.db_url or f"sqlite:///{self.config.state_dir / 'registry.db'}"

    def start_control_plane(self, wait: bool = True) -> Child:
        """Start (or restart on the same port) the control plane, migrating the database."""
        if not self.cp_address:
            self.cp_address = f"{self.config.host}:{free_port()}"
        d = self.config.demo_dir
        self.control_plane = start_child("control-plane", slora_argv(
            "control-plane", "--db", self.db_url, "--listen", self.cp_address,
            "--base-model", f"{BASE_MODEL}={d / 'model'}", "--allowed-root", str(d / "adapters"),
            *[f"--allowed-root={r}" for r in self.config.extra_roots],
            *self.config.control_plane_args, "--migrate"), self.config.state_dir / "logs",
            self.env_for("control-plane"))
        if wait:
            wait_serving(self.cp_address, self.control_plane)
        return self.control_plane

    def start_worker(self, name: str, wait: bool = True, extra: Sequence[str] = (),
                     env: Mapping[str, str] | None = None, wait_s: float = 120.0) -> Child:
        address = f"{self.config.host}:{free_port()}"
        # Each worker gets its own credential: the cluster token alone makes no one a worker.
        credential = mint_with_database(self.db_url, name, base_model=BASE_MODEL)
        child = start_child(name, slora_argv(
            "worker", "--model", str(self.config.demo_dir / "model"),
            "--control-plane", self.cp_address, "--listen", address, "--worker-id", name,
            "--cache-dir", str(self.config.state_dir / "cache" / name),
            *self.config.worker_args, *extra), self.config.state_dir / "logs",
            {**self.env_for("worker"), WORKER_CREDENTIAL_ENV: credential, **(env or {})})
        self.workers[name], self.worker_addresses[name] = child, address
        if wait:
            wait_serving(address, child, timeout_s=wait_s)
        return child

    def start_gateway(self, name: str = "gateway", wait: bool = True, processes: int = 1,
                      extra: Sequence[str] = ()) -> Child:
        address = f"{self.config.host}:{free_port()}"
        http = f"{self.config.host}:{free_port()}"  # the OpenAI-compatible HTTP API
        child = start_child(name, slora_argv(
            "gateway", "--control-plane", self.cp_address, "--listen", address,
            "--http-listen", http, "--base-model-name", BASE_MODEL,
            "--gateway-id", name, "--processes", str(processes), *extra),
            self.config.state_dir / "logs", self.env_for("gateway"))
        self.gateways[name], self.gateway_addresses[name] = child, address
        self.http_urls[name] = f"{'https' if self.config.tls else 'http'}://{http}/v1"
        if wait:
            wait_serving(address, child)
        return child

    def children(self) -> list[Child]:
        cp = [self.control_plane] if self.control_plane else []
        return [*self.gateways.values(), *self.workers.values(), *cp]

    def stop(self) -> None:
        """Stop every child, each draining, side by side (`stop_all`)."""
        stop_all(self.children())


def publish_demo_adapters(admin: AdminClient, demo_dir: Path,
                          names: Sequence[str] | None = None) -> str:
    """Create tenant `demo`, register each demo adapter as version v1 and promote it; returns a
    new tenant-scoped API token. Idempotent for adapters that are already stable."""
    try:
        admin.call("CreateTenant", apb.CreateTenantRequest(name=TENANT))
    except grpc.RpcError as e:
        if e.code() != grpc.StatusCode.ALREADY_EXISTS:
            raise
    adapters = sorted(p for p in (demo_dir / "adapters").iterdir() if p.is_dir())
    for path in adapters:
        if names is not None and path.name not in names:
            continue
        admin.register(path.name, VERSION, path.resolve().as_uri(), digest_adapter_dir(path),
                       BASE_MODEL, TENANT)
        if admin.get(path.name).route.stable_version != VERSION:
            admin.promote(path.name, VERSION, reason="slora up: demo adapter")
    created = admin.call("CreateApiKey", apb.CreateApiKeyRequest(
        scope=apb.KEY_SCOPE_TENANT, tenant=TENANT, name="demo"))
    return str(created.token)


def wait_until_routable(gateway: str, token: str, adapters: Sequence[str],
                        timeout_s: float = 60.0) -> None:
    """Call the gateway (one token, greedy) for the base model and each adapter until all
    succeed: a new key or route reaches gateways within the control plane's poll interval."""
    from slora.v1 import inference_pb2 as pb
    from slora.v1 import inference_pb2_grpc as pb_grpc

    deadline = time.monotonic() + timeout_s
    with open_sync_channel(gateway) as channel:
        stub = pb_grpc.InferenceServiceStub(channel)
        for adapter in ("", *adapters):
            req = pb.GenerateRequest(text="Hello", adapter=pb.AdapterRef(adapter_id=adapter),
                                     sampling=pb.SamplingOptions(max_new_tokens=1, temperature=0))
            while True:
                try:
                    list(stub.Generate(req, timeout=30,
                                       metadata=(("authorization", f"Bearer {token}"),)))
                    break
                except grpc.RpcError as e:
                    if time.monotonic() > deadline:
                        raise RuntimeError(f"{gateway}: {adapter or 'base'} not routable: "
                                           f"{e.code().name} {e.details()}") from None
                    time.sleep(0.1)
