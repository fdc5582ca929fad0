"""`slora admin ...` against a running control plane (tables and --json), and
`slora control-plane` as a real process: migrate, bootstrap key, serve, stop on SIGTERM."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from services.cli import main
from slora_core.adapters import digest_adapter_dir
from tests.services.control_plane.cp_support import ADMIN_TOKEN, BASE, RunningPlane, file_uri

ROOT = Path(__file__).resolve().parents[3]


def slora(capsys: pytest.CaptureFixture[str], plane: RunningPlane, *args: str,
          key: str = ADMIN_TOKEN) -> tuple[int, str, str]:
    status = main(["admin", "--target", plane.target, "--key", key, *args])
    out, err = capsys.readouterr()
    return status, out, err


def slora_json(capsys: pytest.CaptureFixture[str], plane: RunningPlane, *args: str) -> object:
    status, out, err = slora(capsys, plane, "--json", *args)
    assert status == 0, err
    return json.loads(out)


def test_rollout_through_the_cli(capsys: pytest.CaptureFixture[str], plane: RunningPlane,
                                 adapter_root: Path) -> None:
    v1, v2 = adapter_root / "good" / "v1", adapter_root / "good" / "v2"
    assert main(["admin", "digest", str(v1)]) == 0
    assert capsys.readouterr().out.strip() == digest_adapter_dir(v1)
    for version, path in (("v1", v1), ("v2", v2)):
        info = slora_json(capsys, plane, "register", "cli/bot", version, file_uri(path),
                          "--sha256", digest_adapter_dir(path), "--base-model", BASE,
                          "--tenant", "acme", "--label", "owner=ml")
        assert info["state"] == "VERSION_STATE_VALIDATED" and info["labels"] == {"owner": "ml"}
    slora_json(capsys, plane, "promote", "cli/bot", "v1", "--reason", "launch")
    info = slora_json(capsys, plane, "canary", "cli/bot", "v2", "--ratio", "0.2")
    assert info["route"]["canary_version"] == "v2" and info["route"]["traffic_ratio"] == 0.2
    status, out, _ = slora(capsys, plane, "get", "cli/bot")
    assert status == 0
    assert "stable v1  canary v2 (20.0%)  fallback -" in out and "VERSION  STATE" in out
    status, out, _ = slora(capsys, plane, "rollback", "cli/bot", "--reason", "errors up")
    assert status == 0 and "canary -" in out
    status, out, _ = slora(capsys, plane, "list", "--state", "rolled_back")
    assert status == 0 and "cli/bot" in out.splitlines()[1]
    events = slora_json(capsys, plane, "events", "--adapter", "cli/bot", "--limit", "2")
    assert [e["action"] for e in events] == ["canary", "rollback"]
    assert events[1]["reason"] == "errors up"
    status, out, _ = slora(capsys, plane, "events", "--adapter", "cli/bot")
    assert out.splitlines()[0].split() == ["ID", "AT", "ACTOR", "ACTION", "ADAPTER", "VERSION",
                                           "ETAG", "REASON"]


def test_keys_and_tenants_through_the_cli(capsys: pytest.CaptureFixture[str],
                                          plane: RunningPlane) -> None:
    assert slora(capsys, plane, "tenants", "create", "initech")[0] == 0
    created = slora_json(capsys, plane, "keys", "create", "--scope", "tenant", "--tenant",
                         "initech", "--name", "ci")
    token, key_id = created["token"], created["key"]["key_id"]
    status, out, _ = slora(capsys, plane, "tenants", "list", key=token)
    assert status == 0 and [line.split()[0] for line in out.splitlines()[1:]] == ["initech"]
    status, out, _ = slora(capsys, plane, "keys", "list", "--tenant", "initech")
    assert status == 0 and key_id in out
    assert slora(capsys, plane, "keys", "revoke", key_id)[0] == 0
    status, _, err = slora(capsys, plane, "tenants", "list", key=token)
    assert status == 1 and err.startswith("error: UNAUTHENTICATED")


def test_cli_errors_name_the_code(capsys: pytest.CaptureFixture[str], plane: RunningPlane,
                                  adapter_root: Path) -> None:
    status, _, err = slora(capsys, plane, "register", "cli/x", "v1",
                           file_uri(adapter_root / "good" / "v1"), "--sha256", "ab" * 32,
                           "--base-model", BASE, "--tenant", "acme")
    assert status == 1 and err.startswith("error: INVALID_ARGUMENT: sha256 mismatch")
    status, _, err = slora(capsys, plane, "get", "cli/none")
    assert status == 1 and err.startswith("error: NOT_FOUND")
    assert main(["admin", "digest", str(adapter_root / "missing")]) == 1


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait_serving(target: str, proc: subprocess.Popen[bytes], timeout_s: float = 60) -> None:
    deadline = time.monotonic() + timeout_s
    with grpc.insecure_channel(target) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        while time.monotonic() < deadline:
            assert proc.poll() is None, proc.stderr.read().decode() if proc.stderr else ""
            try:
                reply = stub.Check(health_pb2.HealthCheckRequest(service=""), timeout=1)
                if reply.status == health_pb2.HealthCheckResponse.SERVING:
                    return
            except grpc.RpcError:
                time.sleep(0.2)
    raise TimeoutError(f"control plane on {target} did not become SERVING")


def test_control_plane_process(tmp_path: Path, base_model_dir: Path, adapter_root: Path,
                               capsys: pytest.CaptureFixture[str]) -> None:
    target = f"127.0.0.1:{_free_port()}"
    env = {**os.environ, "SLORA_ADMIN_KEY": ADMIN_TOKEN}
    cmd = [sys.executable, "-m", "services.cli", "control-plane", "--db",
           f"sqlite:///{tmp_path / 'cp' / 'registry.db'}", "--listen", target, "--migrate",
           "--base-model", f"{BASE}={base_model_dir}", "--allowed-root", str(adapter_root)]
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stderr=subprocess.PIPE)
    try:
        _wait_serving(target, proc)
        good = adapter_root / "good" / "v1"
        assert main(["admin", "--target", target, "--key", ADMIN_TOKEN, "tenants", "create",
                     "acme"]) == 0
        assert main(["admin", "--target", target, "--key", ADMIN_TOKEN, "register", "p/a", "v1",
                     file_uri(good), "--sha256", digest_adapter_dir(good), "--base-model", BASE,
                     "--tenant", "acme"]) == 0
        assert "validated" in capsys.readouterr().out
    finally:
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == 0
