"""`slora admin policy` and `slora admin status` against a running control plane (tables and
--json), with evidence fed to the control plane as worker heartbeats."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from services.cli import main
from services.common.histogram import Histogram
from slora.v1 import placement_pb2 as ppb
from slora_core.adapters import digest_adapter_dir
from tests.services.control_plane.cp_support import ADMIN_TOKEN, BASE, RunningPlane, file_uri


def slora(capsys: pytest.CaptureFixture[str], plane: RunningPlane, *args: str
          ) -> tuple[int, str, str]:
    status = main(["admin", "--target", plane.target, "--key", ADMIN_TOKEN, *args])
    out, err = capsys.readouterr()
    return status, out, err


def heartbeat(plane: RunningPlane, version: str, requests: int, errors: int) -> None:
    ttft = Histogram()
    for _ in range(requests - errors):
        ttft.observe(0.02)
    store = plane.plane.evidence
    store.worker_counters("w1", store.started_at_ms + 1, [ppb.VersionCounters(
        adapter_id="cli/roll", version=version, requests=requests, errors=errors,
        errors_by_code={"INTERNAL": errors} if errors else {}, ttft=ttft.to_pb())])


def test_policy_and_status_through_the_cli(capsys: pytest.CaptureFixture[str],
                                           plane: RunningPlane, adapter_root: Path) -> None:
    for v in ("v1", "v2"):
        path = adapter_root / "good" / v
        assert slora(capsys, plane, "register", "cli/roll", v, file_uri(path), "--sha256",
                     digest_adapter_dir(path), "--base-model", BASE, "--tenant", "acme")[0] == 0
    assert slora(capsys, plane, "promote", "cli/roll", "v1")[0] == 0
    status, _, err = slora(capsys, plane, "policy", "cli/roll", "--window", "30",
                           "--min-requests", "10")
    assert status == 1 and err.startswith("error: INVALID_ARGUMENT") and "threshold" in err
    status, out, _ = slora(capsys, plane, "--json", "policy", "cli/roll", "--window", "30",
                           "--min-requests", "10", "--max-error-rate-increase", "0.05",
                           "--max-ttft-ratio", "1.5", "--steps", "0.1,0.5")
    assert status == 0
    assert json.loads(out)["canary_policy"] == {
        "window_seconds": 30.0, "min_requests": 10, "max_error_rate_increase": 0.05,
        "max_ttft_ratio": 1.5, "min_feedback": 1, "steps": [0.1, 0.5]}
    assert slora(capsys, plane, "canary", "cli/roll", "v2", "--ratio", "0.1")[0] == 0
    heartbeat(plane, "v2", requests=8, errors=2)
    status, out, _ = slora(capsys, plane, "status", "cli/roll")
    assert status == 0
    lines = out.splitlines()
    assert "stable v1  canary v2 (10.0%)" in out
    assert "policy: window 30s, min 10 requests; failure rate +0.05, ttft x1.5; " \
           "steps 10% -> 50% -> promote" in out
    header = next(i for i, line in enumerate(lines) if line.startswith("VERSION"))
    v2 = lines[header + 2].split()
    assert v2[:7] == ["v2", "canary", "canary", "total", "8", "25.0%", "20.0ms"]
    assert "analysis: canary v2" in out
    status, out, _ = slora(capsys, plane, "--json", "status", "cli/roll")
    figures = {f["version"]: f for f in json.loads(out)["figures"]}
    assert figures["v2"]["total"]["errors_by_code"] == {"INTERNAL": "2"}
    assert figures["v2"]["role"] == "canary" and figures["v1"]["role"] == "stable"
    status, out, _ = slora(capsys, plane, "--json", "policy", "cli/roll", "--clear")
    assert status == 0 and "canary_policy" not in json.loads(out)
