"""The stack the HTTP API tests share (control plane, one CPU worker, one gateway with its
OpenAI-compatible HTTP API) and helpers to read what the `openai` client returns."""

from __future__ import annotations

import functools
import shutil
import time
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import grpc

from devtools.demo_stack import (
    BASE_MODEL,
    TENANT,
    Stack,
    StackConfig,
    publish_demo_adapters,
    wait_until_routable,
)
from services.common.processes import free_port
from services.control_plane.api.client import AdminClient
from services.worker.token_text import TokenText
from slora.v1 import admin_pb2 as apb
from slora_core.adapters import digest_adapter_dir
from slora_core.tokenizer import Tokenizer

ADAPTERS = ("qv-r4", "attn-r8")
MODELS = (BASE_MODEL, *ADAPTERS)
# The shared stack's worker (tests/services/conftest.py): 128 KV pages, and grammars must compile
# within GRAMMAR_TIMEOUT_S (test_structured_http's slow schema runs past it).
GRAMMAR_TIMEOUT_S = 2.0
SHARED_STACK_WORKER_ARGS = ("--num-pages", "128", "--max-num-seqs", "16",
                            "--grammar-compile-timeout-s", str(GRAMMAR_TIMEOUT_S))


@dataclass
class HttpStack:
    stack: Stack
    admin: AdminClient
    token: str
    worker_metrics: int  # the worker's Prometheus port

    @property
    def url(self) -> str:
        return self.stack.http_urls["g1"]

    @property
    def grpc(self) -> str:
        return self.stack.gateway_addresses["g1"]

    def texts(self, ids: list[int]) -> list[str]:
        """The logprob tokens of `ids` as the HTTP API shows them."""
        return token_texts(self.stack.config.demo_dir, ids)

    def upload(self, name: str, source: str) -> Path:
        """A copy of demo adapter `source`'s files, registrable from the uploads root."""
        path = self.stack.config.state_dir / "uploads" / name
        if not path.exists():
            shutil.copytree(self.stack.config.demo_dir / "adapters" / source, path)
        return path

    def register(self, adapter: str, version: str, path: Path) -> None:
        self.admin.register(adapter, version, path.as_uri(), digest_adapter_dir(path),
                            BASE_MODEL, TENANT)

    def other_tenant_key(self) -> str:
        """A key of a second tenant, which may not call the demo tenant's adapters."""
        try:
            self.admin.call("CreateTenant", apb.CreateTenantRequest(name="other"))
        except grpc.RpcError as e:
            if e.code() != grpc.StatusCode.ALREADY_EXISTS:
                raise
        created = self.admin.call("CreateApiKey", apb.CreateApiKeyRequest(
            scope=apb.KEY_SCOPE_TENANT, tenant="other", name="other"))
        return str(created.token)


def token_texts(demo_dir: Path, ids: list[int]) -> list[str]:
    """The logprob tokens OpenAI's shape shows for `ids` (each token's own text)."""
    return [_token_text(demo_dir).of(i)[0] for i in ids]


@functools.cache
def _token_text(demo_dir: Path) -> TokenText:
    return TokenText(Tokenizer.from_dir(demo_dir / "model").backend)


def wait_for(predicate: Callable[[], bool], timeout_s: float, what: str,
             poll_s: float = 0.05) -> float:
    """Seconds until `predicate()` held; AssertionError naming `what` after `timeout_s`."""
    start = time.monotonic()
    while not predicate():
        if time.monotonic() - start > timeout_s:
            raise AssertionError(f"no {what} within {timeout_s} s")
        time.sleep(poll_s)
    return time.monotonic() - start


@contextmanager
def http_stack(demo_dir: Path, state: Path, worker_args: tuple[str, ...] = (),
               worker_env: Mapping[str, str] | None = None) -> Iterator[HttpStack]:
    """Control plane, worker w1 (with metrics, `worker_env` added to its environment) and
    gateway g1 (gRPC and HTTP), demo adapters published; stopped on exit."""
    (state / "uploads").mkdir()
    config = StackConfig(demo_dir=demo_dir, state_dir=state, heartbeat_s=0.5,
                         extra_roots=(state / "uploads",))
    if worker_args:
        config.worker_args = worker_args
    stack = Stack(config)
    metrics = free_port()
    try:
        stack.start_control_plane()
        stack.start_worker("w1", wait=False, extra=("--metrics-port", str(metrics)),
                           env=worker_env)
        stack.start_gateway("g1", wait=False)
        admin = AdminClient.connect(stack.cp_address, stack.admin_token)
        token = publish_demo_adapters(admin, demo_dir, ADAPTERS)
        wait_until_routable(stack.gateway_addresses["g1"], token, ADAPTERS, timeout_s=120)
        yield HttpStack(stack, admin, token, metrics)
    finally:
        stack.stop()
