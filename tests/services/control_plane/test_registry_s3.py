"""Registering from s3:// against a real S3-compatible server (moto) on loopback."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import boto3
import grpc
import pytest

from slora_core.adapters import digest_adapter_dir
from tests.services.control_plane.cp_support import (
    BASE,
    RunningPlane,
    create_pg_schema,
    drop_pg_schema,
    start_plane,
)

BUCKET = "adapters"
CREDENTIALS = {"key": "testing", "secret": "testing"}


@pytest.fixture(scope="module")
def s3_endpoint() -> Iterator[str]:
    from moto.server import ThreadedMotoServer

    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    try:
        yield f"http://{host}:{port}"
    finally:
        server.stop()


@pytest.fixture(scope="module")
def uploaded(s3_endpoint: str, adapter_root: Path) -> dict[str, str]:
    """good/v1 under s3://adapters/acme/support/v1/ and a copy missing its weights."""
    s3 = boto3.client("s3", endpoint_url=s3_endpoint, region_name="us-east-1",
                      aws_access_key_id="testing", aws_secret_access_key="testing")
    s3.create_bucket(Bucket=BUCKET)
    for path in sorted((adapter_root / "good" / "v1").iterdir()):
        s3.upload_file(str(path), BUCKET, f"acme/support/v1/{path.name}")
    s3.upload_file(str(adapter_root / "good" / "v1" / "adapter_config.json"), BUCKET,
                   "acme/partial/adapter_config.json")
    return {"good": f"s3://{BUCKET}/acme/support/v1", "partial": f"s3://{BUCKET}/acme/partial"}


@pytest.fixture(scope="module", params=["sqlite", "postgresql"])
def s3_plane(request: pytest.FixtureRequest, s3_endpoint: str, base_model_dir: Path,
             adapter_root: Path, tmp_path_factory: pytest.TempPathFactory
             ) -> Iterator[RunningPlane]:
    options = {"endpoint_url": s3_endpoint, **CREDENTIALS}
    schema = None
    if request.param == "sqlite":
        url = f"sqlite:///{tmp_path_factory.mktemp('s3db') / 'registry.db'}"
    else:
        request.getfixturevalue("pg_available")
        schema, url = create_pg_schema()
    running = start_plane(url, base_model_dir, (), s3_options=options)
    try:
        from slora.v1 import admin_pb2 as pb

        running.admin.call("CreateTenant", pb.CreateTenantRequest(name="acme"))
        yield running
    finally:
        running.close()
        if schema:
            drop_pg_schema(schema)


def test_register_from_s3(s3_plane: RunningPlane, uploaded: dict[str, str],
                          adapter_root: Path) -> None:
    sha = digest_adapter_dir(adapter_root / "good" / "v1")
    info = s3_plane.admin.register("s3/support", "v1", uploaded["good"], sha, BASE, "acme")
    assert info.storage_uri == uploaded["good"] and info.sha256 == sha and info.rank == 4
    before = s3_plane.dump()
    again = s3_plane.admin.register("s3/support", "v1", uploaded["good"] + "/", sha, BASE, "acme")
    assert again.sha256 == sha and s3_plane.dump() == before


@pytest.mark.parametrize("case", ["missing-bucket", "missing-prefix", "missing-weights",
                                  "wrong-sha256"])
def test_bad_s3_sources(s3_plane: RunningPlane, uploaded: dict[str, str], adapter_root: Path,
                        case: str) -> None:
    sha = digest_adapter_dir(adapter_root / "good" / "v1")
    uri = {"missing-bucket": "s3://no-such-bucket/acme/support/v1",
           "missing-prefix": f"s3://{BUCKET}/acme/nothing-here",
           "missing-weights": uploaded["partial"],
           "wrong-sha256": uploaded["good"]}[case]
    before = s3_plane.dump()
    with pytest.raises(grpc.RpcError) as info:
        s3_plane.admin.register("s3/bad", "v1", uri, "ab" * 32 if case == "wrong-sha256" else sha,
                                BASE, "acme")
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT, info.value.details()
    if case == "missing-bucket":
        assert "bucket" in info.value.details()
    assert s3_plane.dump() == before
