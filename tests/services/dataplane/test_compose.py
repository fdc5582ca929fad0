"""docker-compose.yml: valid against the Compose Specification schema (and to `docker-compose
config` where it is installed), refuses to start without its three secrets, and every service's
command, run as a local process in dependency order (a local PostgreSQL instead of the
container), serves Generate; the one-shot publish-demo prints a key that works.

The schema is `compose_spec.json` as shipped in the docker-compose 1.29.2 wheel (Apache-2.0),
vendored in data/ because tests run without network access."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import jsonschema
import pytest
import yaml

from services.common.processes import Child, free_port, start_child, wait_serving
from tests.services.dataplane.dp_support import generate, request

ROOT = Path(__file__).resolve().parents[3]
SCHEMA = Path(__file__).parent / "data" / "compose_spec.json"
ONE_SHOT = ("demo-assets", "migrate", "worker-credential")  # in dependency order
LONG_RUNNING = ("control-plane", "worker-cpu", "gateway")
LAST = "publish-demo"  # one-shot, after the control plane and the gateway are healthy
SECRETS = {"SLORA_ADMIN_KEY": "test-admin-key-0123456789",
           "SLORA_CLUSTER_TOKEN": "test-cluster-token-0123456789", "SLORA_DB_PASSWORD": "pw0123",
           "SLORA_WORKER_CREDENTIAL": "test-worker-credential-0123456789abcdef",
           "SLORA_GATEWAY_TOKEN": "test-gateway-token-0123456789"}
pytestmark = pytest.mark.timeout(300)


def compose() -> dict:
    return yaml.safe_load((ROOT / "docker-compose.yml").read_text())


def test_compose_file_matches_the_compose_spec_schema() -> None:
    doc = compose()
    # The vendored schema names a nonstandard draft-2019-09 URL; pick the validator directly.
    validator = jsonschema.Draft201909Validator(json.loads(SCHEMA.read_text()))
    validator.validate(doc)
    broken = compose()
    broken["services"]["gateway"]["depends_on"]["control-plane"]["condition"] = "healthy"
    assert not validator.is_valid(broken)  # the schema does check what we rely on
    services = doc["services"]
    assert set(services) == {"postgres", *ONE_SHOT, *LONG_RUNNING, "worker-gpu", LAST}
    assert services["worker-cpu"]["profiles"] == ["cpu"]
    assert services["worker-gpu"]["profiles"] == ["gpu"]
    devices = services["worker-gpu"]["deploy"]["resources"]["reservations"]["devices"]
    assert devices[0]["capabilities"] == ["gpu"]
    for name in (*LONG_RUNNING, "worker-gpu", "postgres"):
        assert "healthcheck" in services[name], name
    assert services["migrate"]["depends_on"]["postgres"]["condition"] == "service_healthy"
    for name, first in (("control-plane", "migrate"), ("worker-credential", "migrate"),
                        ("worker-cpu", "worker-credential"), ("worker-gpu", "worker-credential")):
        assert services[name]["depends_on"][first]["condition"] == \
            "service_completed_successfully"
    for name in ("gateway", "worker-cpu", "worker-gpu", LAST):
        assert services[name]["depends_on"]["control-plane"]["condition"] == "service_healthy"
    assert services[LAST]["depends_on"]["gateway"]["condition"] == "service_healthy"
    # One cluster token for the control plane and everything that watches it.
    tokens = {interpolate(services[name]["environment"]["SLORA_CLUSTER_TOKEN"], SECRETS)
              for name in (*LONG_RUNNING, "worker-gpu")}
    assert tokens == {SECRETS["SLORA_CLUSTER_TOKEN"]}


def test_compose_refuses_to_start_without_real_secrets() -> None:
    services = str(compose()["services"])
    interpolate(services, SECRETS)
    for name in SECRETS:  # no public default: each one missing stops compose
        with pytest.raises(KeyError, match=name):
            interpolate(services, {k: v for k, v in SECRETS.items() if k != name})
    assert "change-me" not in (ROOT / "docker-compose.yml").read_text()


@pytest.mark.skipif(shutil.which("docker-compose") is None,
                    reason="docker-compose (pip install docker-compose) is not installed here")
def test_docker_compose_config_accepts_the_file_only_with_secrets() -> None:
    base = {k: v for k, v in os.environ.items() if k not in SECRETS}

    def config(env: dict[str, str]) -> subprocess.CompletedProcess[str]:
        return subprocess.run(["docker-compose", "--profile", "cpu", "config", "--quiet"],
                              cwd=ROOT, env=env, capture_output=True, text=True, timeout=60)
    res = config({**base, **SECRETS})
    assert res.returncode == 0, res.stderr
    res = config({**base, **{k: v for k, v in SECRETS.items() if k != "SLORA_ADMIN_KEY"}})
    assert res.returncode != 0 and "set SLORA_ADMIN_KEY" in res.stderr, res.stderr


def interpolate(value: str, env: dict[str, str]) -> str:
    """Compose's ${NAME}, ${NAME:-default} and ${NAME:?message} substitution (KeyError for a
    required variable that is unset or empty)."""
    def sub(m: re.Match[str]) -> str:
        name, op, arg = m.group(1), m.group(2) or "", m.group(3) or ""
        if op == ":?" and not env.get(name):
            raise KeyError(f"{name}: {arg}")
        return env.get(name) or (arg if op == ":-" else "")
    return re.sub(r"\$\{(\w+)(?:(:-|:\?)([^}]*))?\}", sub, value)


class LocalCompose:
    """Runs compose services as local processes: host names and ports rewritten to loopback
    and free ports, /data to a temporary folder, `slora` to this interpreter."""

    def __init__(self, tmp: Path, db_url: str) -> None:
        self.tmp, self.db_url = tmp, db_url
        self.ports = {p: free_port() for p in ("50051", "50061", "50071", "8080", "9100",
                                               "9101")}
        self.rewrites = [
            ("/data", str(tmp / "data")),
            *[(f"{host}:{p}", f"127.0.0.1:{local}") for p, local in self.ports.items()
              for host in ("0.0.0.0", "control-plane", "worker-cpu", "gateway", "127.0.0.1")],
        ]

    def local(self, port: str) -> str:
        return f"127.0.0.1:{self.ports[port]}"

    def argv(self, args: list[str]) -> list[str]:
        out = []
        for arg in args:
            for old, new in self.rewrites:
                arg = arg.replace(old, new)
            out.append(str(self.ports[arg]) if arg in self.ports else arg)
        if out[0] == "slora":
            return [sys.executable, "-m", "services.cli", *out[1:]]
        if out[0] == "python":
            return [sys.executable, *out[1:]]
        return out

    def env(self, service: dict) -> dict[str, str]:
        env = {k: interpolate(str(v), SECRETS) for k, v in service.get("environment", {}).items()}
        env["SLORA_DB_URL"] = self.db_url  # the local PostgreSQL, one schema per test
        env["SLORA_HEARTBEAT_S"] = "0.5"
        return env

    def start(self, name: str, service: dict) -> Child:
        return start_child(name, self.argv(service["command"]), self.tmp / "logs",
                           self.env(service), cwd=ROOT)


@pytest.fixture
def pg_url() -> Iterator[str]:
    from tests.services.control_plane.cp_support import (
        create_pg_schema,
        drop_pg_schema,
        start_postgres,
    )
    if not start_postgres():
        pytest.skip("PostgreSQL on 127.0.0.1:5432 is not reachable and could not be started")
    schema, url = create_pg_schema()
    try:
        yield url
    finally:
        drop_pg_schema(schema)


@pytest.mark.slow  # ~1 min: every Compose service as a local process, on PostgreSQL
def test_every_compose_service_runs_locally_and_serves_generate(pg_url: str, tmp_path: Path
                                                               ) -> None:
    services = compose()["services"]
    stack = LocalCompose(tmp_path, pg_url)
    children: list[Child] = []
    try:
        for name in ONE_SHOT:  # depends_on: service_completed_successfully
            child = stack.start(name, services[name])
            children.append(child)
            assert child.popen.wait(120) == 0, child.log_tail()
        for name in LONG_RUNNING:
            children.append(stack.start(name, services[name]))
            if name == "control-plane":  # the others wait for it to be healthy
                wait_serving(stack.local("50051"), children[-1])
        for name, port in (("control-plane", "50051"), ("worker-cpu", "50061"),
                           ("gateway", "50071")):
            child = next(c for c in children if c.name == name)
            wait_serving(stack.local(port), child, timeout_s=120)
            check = stack.argv(services[name]["healthcheck"]["test"][1:])
            assert start_child(f"{name}-health", check, tmp_path / "logs", cwd=ROOT
                               ).popen.wait(30) == 0
        publish = stack.start(LAST, services[LAST])
        children.append(publish)
        assert publish.popen.wait(180) == 0, publish.log_tail()
        printed = publish.log_tail()
        token = re.search(r"tenant API key \(shown once\): (\S+)", printed).group(1)
        http = f"http://{stack.local('8080')}/v1"  # --public-http, rewritten like the rest
        assert f"{http}/completions" in printed
        answer = httpx.post(f"{http}/completions", headers={"Authorization": f"Bearer {token}"},
                            json={"model": "qv-r4", "prompt": "Hello", "max_tokens": 4},
                            timeout=60)
        assert answer.status_code == 200, answer.text
        assert answer.json()["usage"]["completion_tokens"] == 4
        res = generate(stack.local("50071"), request(adapter="qv-r4", temperature=0), token)
        assert res.error is None and res.complete is not None, res
        assert res.complete.served_by.worker_id == "worker"
        assert res.complete.usage.completion_tokens == 8
    finally:
        for child in reversed(children):
            child.stop()


@pytest.mark.skipif(os.environ.get("SLORA_DOCKER_E2E") != "1",
                    reason="builds the image and runs compose for minutes: set SLORA_DOCKER_E2E=1 "
                           "where docker and docker-compose run (deploy/compose_e2e.sh)")
@pytest.mark.timeout(1800)
def test_compose_up_end_to_end_in_containers(tmp_path: Path) -> None:
    res = subprocess.run(["bash", str(ROOT / "deploy" / "compose_e2e.sh"), str(tmp_path)],
                         capture_output=True, text=True, timeout=1700)
    assert res.returncode == 0, res.stdout[-4000:] + res.stderr[-4000:]
    assert "PASS" in res.stdout
