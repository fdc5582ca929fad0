"""The processes behind `slora serve`: control plane (SQLite), one worker, one gateway, on
loopback except the gateway's HTTP API; the adapters registered and promoted."""

from __future__ import annotations

import secrets
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import grpc

from devtools.demo_stack import wait_until_routable
from services.commands.serve import ADAPTER_VERSION, TENANT, LoraModule
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
from services.control_plane.api.client import AdminClient
from services.control_plane.store.worker_credentials import mint_with_database
from services.gateway.http_api import API_KEY_ENV, OPEN_KEY_ENV
from slora.v1 import admin_pb2 as apb
from slora_core.adapters import digest_adapter_dir

LOOPBACK = "127.0.0.1"


@dataclass
class ServeStack:
    model: Path
    name: str                  # the base model's `model` name
    adapters: Sequence[LoraModule]
    state: Path
    http: str                  # host:port of the OpenAI API
    worker_flags: Sequence[str]
    api_key: str = ""
    admin_token: str = field(default_factory=lambda: "slk_admin_" + secrets.token_urlsafe(24))
    cluster_token: str = field(default_factory=new_cluster_token)
    gateway_token: str = field(default_factory=new_gateway_token)
    children: list[Child] = field(default_factory=list)

    @property
    def db_url(self) -> str:
        return f"sqlite:///{self.state / 'registry.db'}"

    def start(self, say: Callable[[str], None]) -> None:
        """Start every process and register the adapters; RuntimeError when one fails."""
        logs = self.state / "logs"
        base = {"PYTHONUNBUFFERED": "1"}
        cp = f"{LOOPBACK}:{free_port()}"
        roots = sorted({str(a.path.parent) for a in self.adapters})
        say("starting the control plane (SQLite)")
        control = self._child(start_child("control-plane", slora_argv(
            "control-plane", "--db", self.db_url, "--listen", cp, "--migrate",
            "--base-model", f"{self.name}={self.model}",
            *[f"--allowed-root={r}" for r in roots]), logs,
            {**base, "SLORA_ADMIN_KEY": self.admin_token, CLUSTER_TOKEN_ENV: self.cluster_token}))
        wait_serving(cp, control)
        say("starting the worker (the model loads) and the gateway")
        worker = f"{LOOPBACK}:{free_port()}"
        credential = mint_with_database(self.db_url, "serve-worker")
        self._child(start_child("worker", slora_argv(
            "worker", "--model", str(self.model), "--control-plane", cp, "--listen", worker,
            "--worker-id", "serve-worker", "--cache-dir", str(self.state / "cache"),
            *self.worker_flags), logs,
            {**base, GATEWAY_TOKEN_ENV: self.gateway_token,
             WORKER_CREDENTIAL_ENV: credential}))
        key = self._register(cp)
        gateway = f"{LOOPBACK}:{free_port()}"
        env = {**base, CLUSTER_TOKEN_ENV: self.cluster_token,
               GATEWAY_TOKEN_ENV: self.gateway_token, OPEN_KEY_ENV: key}
        if self.api_key:
            env[API_KEY_ENV] = self.api_key
        self._child(start_child("gateway", slora_argv(
            "gateway", "--control-plane", cp, "--listen", gateway, "--http-listen", self.http,
            "--base-model-name", self.name, "--gateway-id", "serve-gateway"), logs, env))
        wait_serving(gateway, self.children[-1])
        wait_serving(worker, self.children[1], timeout_s=600)
        wait_until_routable(gateway, key, [a.name for a in self.adapters], timeout_s=120)

    def _register(self, cp: str) -> str:
        """Register and promote each adapter under the serve tenant; its new key."""
        admin = AdminClient.connect(cp, self.admin_token)
        try:
            admin.call("CreateTenant", apb.CreateTenantRequest(name=TENANT))
        except grpc.RpcError as exc:
            if exc.code() != grpc.StatusCode.ALREADY_EXISTS:
                raise
        for a in self.adapters:
            try:
                admin.register(a.name, ADAPTER_VERSION, a.path.as_uri(),
                               digest_adapter_dir(a.path), self.name, TENANT)
            except grpc.RpcError as exc:
                raise RuntimeError(f"adapter {a.name} ({a.path}): {exc.details()}") from None
            if admin.get(a.name).route.stable_version != ADAPTER_VERSION:
                admin.promote(a.name, ADAPTER_VERSION, reason="slora serve --lora-modules")
        created = admin.call("CreateApiKey", apb.CreateApiKeyRequest(
            scope=apb.KEY_SCOPE_TENANT, tenant=TENANT, name="serve"))
        return str(created.token)

    def _child(self, child: Child) -> Child:
        self.children.append(child)
        return child

    def stop(self) -> None:
        stop_all(self.children)  # gateway, worker and control plane draining side by side
