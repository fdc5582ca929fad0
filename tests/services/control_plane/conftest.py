"""Fixtures of the control-plane tests; the helpers live in cp_support.py."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from slora.v1 import admin_pb2 as pb
from tests.services.control_plane.cp_support import (
    BACKENDS,
    HF_CONFIG,
    RunningPlane,
    create_pg_schema,
    drop_pg_schema,
    make_peft_adapter,
    start_plane,
    start_postgres,
)


@pytest.fixture(scope="session")
def pg_available() -> None:
    if not start_postgres():
        pytest.skip("PostgreSQL on 127.0.0.1:5432 is not reachable and could not be started")


def _empty_db(backend: str, request: pytest.FixtureRequest, folder: Path) -> Iterator[str]:
    if backend == "sqlite":
        yield f"sqlite:///{folder / 'registry.db'}"
        return
    request.getfixturevalue("pg_available")
    schema, url = create_pg_schema()
    try:
        yield url
    finally:
        drop_pg_schema(schema)


@pytest.fixture(params=BACKENDS)
def empty_db(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[str]:
    """URL of an empty database, once per backend."""
    yield from _empty_db(request.param, request, tmp_path)


@pytest.fixture(scope="session")
def base_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A Hugging Face directory with only config.json: all the registry reads of a base."""
    from transformers import LlamaConfig

    path = tmp_path_factory.mktemp("base")
    LlamaConfig(**HF_CONFIG).save_pretrained(path)
    return path


@pytest.fixture(scope="session")
def adapter_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The allowed root, holding good adapters good/v1..v3 (different seeds)."""
    root = tmp_path_factory.mktemp("adapters")
    for i in (1, 2, 3):
        make_peft_adapter(root / "good" / f"v{i}", seed=i)
    return root


@pytest.fixture(scope="module", params=BACKENDS)
def plane(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory,
          base_model_dir: Path, adapter_root: Path) -> Iterator[RunningPlane]:
    """A server per test module and backend on a freshly migrated database, tenant 'acme'."""
    for db_url in _empty_db(request.param, request, tmp_path_factory.mktemp("db")):
        running = start_plane(db_url, base_model_dir, (adapter_root,))
        try:
            running.admin.call("CreateTenant", pb.CreateTenantRequest(name="acme"))
            yield running
        finally:
            running.close()
