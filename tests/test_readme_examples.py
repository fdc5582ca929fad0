"""README's shell examples run as written: every command of every ```sh block exits 0, run in
order from one folder against a `slora up` stack started there (the README's own command).

A block is left out only by a marker in its fence, ```sh skip=REASON, with REASON one of
SKIP_REASONS (set-up of a fresh machine, Docker, a foreground server); the test checks that
nothing else is skipped and that the blocks it runs are there."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
SKIP_REASONS = {"setup", "docker"}
FENCE = re.compile(r"^```sh(?: skip=(\w+))?\n(.*?)^```$", re.S | re.M)
pytestmark = pytest.mark.timeout(300)


def sh_blocks(text: str) -> list[tuple[str | None, str]]:
    """(skip reason or None, body) of every ```sh block, in order."""
    blocks = [(m.group(1), m.group(2)) for m in FENCE.finditer(text)]
    assert len(blocks) == text.count("```sh"), "a ```sh fence this test cannot read"
    return blocks


def commands(body: str) -> list[str]:
    """One entry per command: continuation lines joined, comment-only lines dropped."""
    joined = re.sub(r"\\\n\s*", "", body)
    return [line for line in joined.splitlines() if line.strip() and
            not line.lstrip().startswith("#")]


def test_readme_blocks_are_run_or_skipped_for_a_stated_reason() -> None:
    blocks = sh_blocks(README.read_text())
    assert {reason for reason, _ in blocks if reason} <= SKIP_REASONS
    run = [body for reason, body in blocks if reason is None]
    assert len(run) >= 3 and any("admin register" in b for b in run)
    assert any("admin digest" in b for b in run) and any("slora batch" in b for b in run)


def start_up(folder: Path) -> subprocess.Popen[bytes]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLORA_")}
    log = open(folder / "up.log", "wb")  # noqa: SIM115 (the child keeps it open)
    up = subprocess.Popen([".venv/bin/slora", "up"], cwd=folder, env=env, stdout=log,
                          stderr=subprocess.STDOUT, start_new_session=True)
    deadline = time.monotonic() + 180
    while "slora is up" not in (folder / "up.log").read_text(errors="replace"):
        assert up.poll() is None, (folder / "up.log").read_text()
        assert time.monotonic() < deadline, (folder / "up.log").read_text()
        time.sleep(0.3)
    return up


def test_every_readme_shell_command_exits_0(tmp_path: Path) -> None:
    (tmp_path / ".venv").symlink_to(ROOT / ".venv")  # the README's .venv/bin/slora
    up = start_up(tmp_path)
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLORA_")}
    try:
        for reason, body in sh_blocks(README.read_text()):
            if reason is not None:
                continue
            for cmd in commands(body):
                res = subprocess.run(["bash", "-o", "pipefail", "-c", cmd], cwd=tmp_path,
                                     env=env, capture_output=True, text=True, timeout=120)
                assert res.returncode == 0, f"{cmd}\n{res.stdout}\n{res.stderr}"
    finally:
        up.send_signal(signal.SIGINT)
        assert up.wait(60) == 0, (tmp_path / "up.log").read_text()
    outputs = (tmp_path / "outputs.jsonl").read_text().splitlines()
    assert len(outputs) == 2 and all('"finish_reason"' in line for line in outputs)
