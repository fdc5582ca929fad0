"""Bad inputs, each answered with its DESIGN section 2 code and the registry left unchanged
(a dump of every table before and after), on SQLite and PostgreSQL."""

from __future__ import annotations

import shutil
from collections.abc import Callable
from pathlib import Path

import grpc
import pytest
import torch
from safetensors.torch import load_file, save_file

from services.control_plane.api.client import AdminClient
from slora.v1 import admin_pb2 as pb
from slora_core.adapters import digest_adapter_dir
from tests.services.control_plane.cp_support import BASE, RunningPlane, file_uri, make_peft_adapter

WEIGHTS, CONFIG = "adapter_model.safetensors", "adapter_config.json"
BAD = grpc.StatusCode.INVALID_ARGUMENT
INCOMPATIBLE = grpc.StatusCode.FAILED_PRECONDITION


def _copy_good(adapter_root: Path, name: str) -> Path:
    return Path(shutil.copytree(adapter_root / "good" / "v1", adapter_root / "bad" / name))


def _set_nan(path: Path) -> None:
    tensors = load_file(str(path / WEIGHTS))
    key = sorted(tensors)[0]
    tensors[key] = tensors[key].clone()
    tensors[key].view(-1)[3] = torch.nan
    save_file(tensors, str(path / WEIGHTS))


def _truncate(path: Path) -> None:
    data = (path / WEIGHTS).read_bytes()
    (path / WEIGHTS).write_bytes(data[: len(data) // 2])


def _corrupt(path: Path) -> None:
    size = (path / WEIGHTS).stat().st_size
    (path / WEIGHTS).write_bytes(bytes(range(256)) * (size // 256 + 1))


@pytest.fixture(scope="module")
def bad_dirs(adapter_root: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Broken adapters inside the allowed root (and two ways of leaving it)."""
    if (adapter_root / "bad").exists():
        shutil.rmtree(adapter_root / "bad")
    dirs: dict[str, Path] = {}
    for name, damage in (("nan", _set_nan), ("truncated", _truncate), ("corrupt", _corrupt)):
        dirs[name] = _copy_good(adapter_root, name)
        damage(dirs[name])
    dirs["bad_config"] = _copy_good(adapter_root, "bad_config")
    (dirs["bad_config"] / CONFIG).write_text('{"r": 4, "lora_alpha": ')
    dirs["missing_weights"] = _copy_good(adapter_root, "missing_weights")
    (dirs["missing_weights"] / WEIGHTS).unlink()
    dirs["other_base"] = make_peft_adapter(adapter_root / "bad" / "other_base", seed=7,
                                           hf_overrides={"hidden_size": 48})
    dirs["rank_16"] = make_peft_adapter(adapter_root / "bad" / "rank_16", seed=8, r=16)
    outside = tmp_path_factory.mktemp("outside")
    dirs["outside"] = Path(shutil.copytree(adapter_root / "good" / "v1", outside / "a"))
    dirs["symlink_out"] = adapter_root / "bad" / "symlink_out"
    dirs["symlink_out"].symlink_to(dirs["outside"], target_is_directory=True)
    return dirs


def _sha(path: Path) -> str:
    try:
        return digest_adapter_dir(path)
    except ValueError:
        return "0" * 64


RegisterCall = Callable[[AdminClient, dict[str, Path], Path], object]


def _reg(name: str, *, sha: str | None = None, adapter_id: str = "bad/a", version: str = "v1",
         base: str = BASE, tenant: str = "acme") -> RegisterCall:
    def call(client: AdminClient, dirs: dict[str, Path], root: Path) -> object:
        path = dirs[name] if name in dirs else root / name
        return client.register(adapter_id, version, file_uri(path), sha or _sha(path), base,
                               tenant)

    return call


CASES: dict[str, tuple[RegisterCall, grpc.StatusCode]] = {
    "wrong-sha256": (_reg("good/v1", sha="ab" * 32), BAD),
    "sha256-not-hex": (_reg("good/v1", sha="xyz"), BAD),
    "missing-directory": (_reg("bad/does-not-exist"), BAD),
    "missing-weights-file": (_reg("missing_weights"), BAD),
    "truncated-safetensors": (_reg("truncated"), BAD),
    "corrupt-safetensors": (_reg("corrupt"), BAD),
    "malformed-adapter-config": (_reg("bad_config"), BAD),
    "nan-weights": (_reg("nan"), BAD),
    "shapes-of-another-base": (_reg("other_base"), INCOMPATIBLE),
    "rank-over-limit": (_reg("rank_16"), INCOMPATIBLE),
    "file-outside-allowed-roots": (_reg("outside"), BAD),
    "symlink-leaving-allowed-roots": (_reg("symlink_out"), BAD),
    "unknown-base-model": (_reg("good/v1", base="llama-70b"), BAD),
    "unknown-tenant": (_reg("good/v1", tenant="nobody"), grpc.StatusCode.NOT_FOUND),
    "bad-adapter-id": (_reg("good/v1", adapter_id="../etc"), BAD),
    "bad-version": (_reg("good/v1", version="v 1"), BAD),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_bad_registration(plane: RunningPlane, bad_dirs: dict[str, Path], adapter_root: Path,
                          case: str) -> None:
    call, code = CASES[case]
    before = plane.dump()
    with pytest.raises(grpc.RpcError) as info:
        call(plane.admin, bad_dirs, adapter_root)
    assert info.value.code() == code, info.value.details()
    assert info.value.details()
    assert plane.dump() == before


def test_bad_storage_uri_schemes(plane: RunningPlane) -> None:
    before = plane.dump()
    for uri in ("http://example.com/a", "file://otherhost/a", "s3:///no-bucket", "relative/a"):
        with pytest.raises(grpc.RpcError) as info:
            plane.admin.register("bad/a", "v1", uri, "ab" * 32, BASE, "acme")
        assert info.value.code() == BAD, uri
    assert plane.dump() == before


def test_route_changes_without_a_ready_version(plane: RunningPlane, adapter_root: Path) -> None:
    """Promote of a version that never validated (its registration failed), and rollback with
    no fallback, leave everything as it was."""
    good = adapter_root / "good" / "v1"
    plane.admin.register("bad/route", "v1", file_uri(good), digest_adapter_dir(good), BASE, "acme")
    with pytest.raises(grpc.RpcError):
        plane.admin.register("bad/route", "v2", file_uri(good), "cd" * 32, BASE, "acme")
    before = plane.dump()
    cases = [
        (lambda: plane.admin.promote("bad/route", "v2"), grpc.StatusCode.NOT_FOUND),
        (lambda: plane.admin.rollback("bad/route", "nothing to go back to"), INCOMPATIBLE),
        (lambda: plane.admin.call("Rollback", pb.RollbackRequest(adapter_id="bad/route")), BAD),
    ]
    for call, code in cases:
        with pytest.raises(grpc.RpcError) as info:
            call()
        assert info.value.code() == code
    assert plane.dump() == before
