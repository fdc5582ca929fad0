"""A worker's credential read from a file ($SLORA_WORKER_CREDENTIAL_FILE, a mounted Kubernetes
Secret key): used when $SLORA_WORKER_CREDENTIAL is unset, stripped, and a missing or empty file
is a one-line error that never holds the credential."""

from __future__ import annotations

from pathlib import Path

import pytest

from services.cli import main
from services.common.identity import (
    WORKER_CREDENTIAL_ENV,
    WORKER_CREDENTIAL_FILE_ENV,
    CredentialFileError,
    worker_credential,
    worker_metadata,
)

TOKEN = "slw_" + "k" * 43


def test_the_file_is_read_and_stripped(tmp_path: Path) -> None:
    f = tmp_path / "worker-0"
    f.write_text(TOKEN + "\n")  # `slora worker-credential mint > worker-0` ends with a newline
    env = {WORKER_CREDENTIAL_FILE_ENV: str(f)}
    assert worker_credential(env) == TOKEN
    assert worker_metadata("slc_cluster", env) == (("authorization", f"Bearer {TOKEN}"),)


def test_the_variable_wins_and_nothing_configured_falls_back(tmp_path: Path) -> None:
    missing = str(tmp_path / "absent")
    assert worker_credential({WORKER_CREDENTIAL_ENV: TOKEN,
                              WORKER_CREDENTIAL_FILE_ENV: missing}) == TOKEN
    assert worker_credential({}) == ""
    assert worker_metadata("slc_cluster", {}) == (("authorization", "Bearer slc_cluster"),)


@pytest.mark.parametrize("content", [None, "", " \n"])
def test_a_missing_or_empty_file_is_a_one_line_error(tmp_path: Path, content: str | None) -> None:
    f = tmp_path / "worker-0"
    if content is not None:
        f.write_text(content)
    with pytest.raises(CredentialFileError) as err:
        worker_credential({WORKER_CREDENTIAL_FILE_ENV: str(f)})
    message = str(err.value)
    assert "\n" not in message and str(f) in message and WORKER_CREDENTIAL_FILE_ENV in message
    assert ("empty" if content is not None else "No such file") in message


def test_an_unreadable_file_names_no_content(tmp_path: Path) -> None:
    f = tmp_path / "worker-0"
    f.write_bytes(b"\xff" + TOKEN.encode())  # not UTF-8: refused, and the bytes are not echoed
    with pytest.raises(CredentialFileError) as err:
        worker_credential({WORKER_CREDENTIAL_FILE_ENV: str(f)})
    assert TOKEN not in str(err.value) and "\n" not in str(err.value)


def test_slora_worker_stops_before_loading_without_its_file(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(WORKER_CREDENTIAL_ENV, raising=False)
    monkeypatch.setenv(WORKER_CREDENTIAL_FILE_ENV, str(tmp_path / "worker-7"))
    with pytest.raises(SystemExit) as stop:  # the model dir does not exist: never reached
        main(["worker", "--model", str(tmp_path / "no-model"), "--control-plane", "x:1"])
    assert str(stop.value).startswith(f"worker: {WORKER_CREDENTIAL_FILE_ENV}=")
    assert "\n" not in str(stop.value)
