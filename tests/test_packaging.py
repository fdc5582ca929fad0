"""The wheel is enough: built from a copy of the sources without generated code, installed
(non-editable) into a fresh venv, `slora up` runs from a folder outside the checkout, and
`slora generate` and `slora admin` reach the stack it started.

Offline and quick: the wheel is built without build isolation and installed with `--no-deps`;
the fresh venv sees this venv's site-packages (torch and the rest) through a .pth line, which
does not run this venv's own .pth files, so the checkout's editable install stays invisible."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import sysconfig
import tarfile
import time
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
pytestmark = pytest.mark.timeout(240)


def sh(argv: list[str], cwd: Path, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTHON", "SLORA_"))}
    res = subprocess.run(argv, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
    assert res.returncode == 0, f"{argv}\n{res.stdout}\n{res.stderr}"
    return res


def copy_sources(dest: Path) -> None:
    """The files git tracks or would track: no .venv, no generated slora/v1/*_pb2*."""
    files = subprocess.run(["git", "ls-files", "-co", "--exclude-standard", "-z"], cwd=ROOT,
                           capture_output=True, text=True, check=True).stdout.split("\0")
    for name in filter(None, files):
        src = ROOT / name
        if src.is_file():
            (dest / name).parent.mkdir(parents=True, exist_ok=True)
            (dest / name).write_bytes(src.read_bytes())


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Built as `python -m build` does: sources -> sdist -> wheel from the unpacked sdist, so
    the sdist must carry what the build needs (proto/, the migrations, setup.py)."""
    src, out = tmp_path_factory.mktemp("src"), tmp_path_factory.mktemp("wheels")
    copy_sources(src)
    assert not list((src / "slora" / "v1").glob("*_pb2*.py"))
    sh([sys.executable, "-c", "from setuptools import build_meta as b; b.build_sdist('dist')"],
       cwd=src)
    (sdist,) = (src / "dist").glob("slora-*.tar.gz")
    with tarfile.open(sdist) as tar:
        tar.extractall(out / "sdist", filter="data")
    (unpacked,) = (out / "sdist").iterdir()
    sh([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q",
        "-w", str(out), str(unpacked)], cwd=out)
    (path,) = out.glob("slora-*.whl")
    return path


def test_wheel_carries_generated_protos_and_migrations(wheel: Path) -> None:
    names = set(zipfile.ZipFile(wheel).namelist())
    for proto in ("admin", "inference", "placement", "evidence"):
        assert {f"slora/v1/{proto}_pb2.py", f"slora/v1/{proto}_pb2_grpc.py"} <= names
    migrations = "services/control_plane/migrations/"
    assert {f"{migrations}alembic.ini", f"{migrations}env.py",
            f"{migrations}script.py.mako"} <= names
    assert any(n.startswith(f"{migrations}versions/0001_") for n in names)


def fresh_venv(path: Path, wheel: Path) -> Path:
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(path)], check=True)
    site = path / "lib" / f"python{sys.version_info.major}.{sys.version_info.minor}" / \
        "site-packages"
    deps = {sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"]}
    (site / "slora-test-deps.pth").write_text("\n".join(sorted(deps)) + "\n")
    sh([sys.executable, "-m", "pip", "--python", str(path / "bin" / "python"), "install",
        "--no-deps", "--no-index", "-q", str(wheel)], cwd=path)
    return path / "bin"


def wait_for_line(log: Path, proc: subprocess.Popen[bytes], text: str, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while text not in log.read_text(errors="replace"):
        assert proc.poll() is None, f"slora up exited {proc.returncode}:\n{log.read_text()}"
        assert time.monotonic() < deadline, f"no {text!r} in time:\n{log.read_text()}"
        time.sleep(0.3)


@pytest.mark.slow  # ~1 min; test_readme_examples runs `slora up` from a checkout by default
def test_installed_wheel_runs_slora_up_outside_the_checkout(wheel: Path, tmp_path: Path) -> None:
    bin_dir = fresh_venv(tmp_path / "venv", wheel)
    run = tmp_path / "run"
    run.mkdir()
    where = sh([str(bin_dir / "python"), "-c", "import services.control_plane.store.db as d, "
                "slora.v1.admin_pb2 as p; print(d.MIGRATIONS_DIR); print(p.__file__)"], cwd=run)
    assert all(line.startswith(str(tmp_path / "venv")) for line in where.stdout.split()), where

    log = run / "up.log"
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTHON", "SLORA_"))}
    with open(log, "wb") as out:
        up = subprocess.Popen([str(bin_dir / "slora"), "up"], cwd=run, env=env, stdout=out,
                              stderr=subprocess.STDOUT, start_new_session=True)
    try:
        wait_for_line(log, up, "slora is up", timeout_s=150)
        gen = sh([str(bin_dir / "slora"), "generate", "--adapter", "qv-r4", "--max-new-tokens",
                  "4", "The quick brown fox"], cwd=run)
        assert "qv-r4@v1" in gen.stderr + gen.stdout, gen
        # slora admin finds the control plane and its admin key from .slora/up/ alone.
        listed = sh([str(bin_dir / "slora"), "admin", "list"], cwd=run)
        assert "qv-r4" in listed.stdout, listed
    finally:
        up.send_signal(signal.SIGINT)
        code = up.wait(60)
    assert code == 0, log.read_text()
