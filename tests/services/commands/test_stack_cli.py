"""Start-up and connection settings of the stack commands: the control plane refuses an
un-migrated database and a short admin key in one line; `slora admin` finds what `slora up`
wrote (and never sends that admin key to another control plane); secrets files are 0600."""

from __future__ import annotations

import stat
from pathlib import Path

import pytest

from services.cli import build_parser, main
from services.commands.admin_calls import resolve_target_and_key
from services.commands.up import write_private
from services.control_plane.store.db import make_engine, upgrade


def refusal(capsys: pytest.CaptureFixture[str], *argv: str) -> str:
    with pytest.raises(SystemExit) as exc:
        main(["control-plane", "--listen", "127.0.0.1:0", *argv])
    out = capsys.readouterr()
    assert out.out == "" and out.err == ""  # no log lines, no traceback: the message only
    message = str(exc.value.code)
    assert "\n" not in message and message.startswith("slora control-plane: ")
    return message


def test_control_plane_refuses_an_unmigrated_database(tmp_path, capsys, monkeypatch):
    monkeypatch.delenv("SLORA_ADMIN_KEY", raising=False)
    db = f"sqlite:///{tmp_path / 'registry.db'}"
    message = refusal(capsys, "--db", db)
    assert "none (empty)" in message and "--migrate-only" in message
    upgrade(db, "0001")
    assert "at migration 0001" in refusal(capsys, "--db", db)
    engine = make_engine(db)
    with engine.begin() as conn:  # as if a newer slora had migrated it
        conn.exec_driver_sql("UPDATE alembic_version SET version_num = '9999'")
    engine.dispose()
    assert "9999, which this slora does not know" in refusal(capsys, "--db", db)


def test_control_plane_refuses_a_short_admin_key(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("SLORA_ADMIN_KEY", "too-short")
    message = refusal(capsys, "--db", f"sqlite:///{tmp_path / 'r.db'}", "--migrate")
    assert "has 9 chars; it needs 16+" in message
    assert not (tmp_path / "r.db").exists()  # refused before touching the database


def test_unreachable_database_is_one_line(capsys, monkeypatch):
    monkeypatch.delenv("SLORA_ADMIN_KEY", raising=False)
    message = refusal(capsys, "--db", "postgresql+psycopg://u:p@127.0.0.1:1/none")
    assert "cannot read the registry database" in message


def admin_args(*argv: str):
    return build_parser().parse_args(["admin", *argv, "list"])


def test_admin_reads_what_slora_up_wrote(tmp_path, monkeypatch):
    for name in ("SLORA_TARGET", "SLORA_KEY", "SLORA_KEY_FILE"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.chdir(tmp_path)
    assert resolve_target_and_key(admin_args()) == ("127.0.0.1:50051", "")
    state = tmp_path / ".slora" / "up"
    state.mkdir(parents=True)
    write_private(state / "admin.key", "slk_admin_secret\n")
    write_private(state / "connection.env",
                  f"SLORA_TARGET=127.0.0.1:4242\nSLORA_KEY_FILE={state / 'admin.key'}\n")
    assert resolve_target_and_key(admin_args()) == ("127.0.0.1:4242", "slk_admin_secret")
    # Explicit settings win; the saved key never goes to a control plane it was not made for.
    assert resolve_target_and_key(admin_args("--key", "k")) == ("127.0.0.1:4242", "k")
    assert resolve_target_and_key(admin_args("--target", "10.0.0.1:1")) == ("10.0.0.1:1", "")
    monkeypatch.setenv("SLORA_TARGET", "10.0.0.2:1")
    assert resolve_target_and_key(admin_args()) == ("10.0.0.2:1", "")
    with pytest.raises(SystemExit, match="cannot read the key file"):
        resolve_target_and_key(admin_args("--key-file", str(tmp_path / "missing")))


def test_private_files_are_0600_even_when_they_existed(tmp_path: Path):
    path = tmp_path / "secret"
    path.write_text("old")
    path.chmod(0o644)
    write_private(path, "new")
    assert path.read_text() == "new"
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
