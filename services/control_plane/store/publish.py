"""Verified publishing of an adapter version: fetch, check the digest, validate, then commit.

Nothing is written until the files have been downloaded, their sha256 compared with the one the
caller gave and the engine's validator has accepted them against the base model; the commit then
inserts the adapter (with an empty route) if new, the version, and an audit event, in one
transaction.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

from sqlalchemy.orm import Session

from services.common.errors import AlreadyExists, FailedPrecondition, InvalidArgument
from services.common.names import check_adapter_id, check_name, check_version, shown
from services.control_plane.domain.adapter_check import (
    MAX_CONFIG_BYTES,
    AdapterSummary,
    max_weights_bytes,
    validate_adapter_dir,
)
from services.control_plane.domain.lifecycle import VersionState
from services.control_plane.domain.principal import Principal
from services.control_plane.store.audit import record_event
from services.control_plane.store.models import Adapter, AdapterVersion, Route
from services.control_plane.store.storage import StorageConfig, fetch_adapter, staging_dir
from slora_core.adapters.files import CONFIG_FILE, WEIGHTS_FILE
from slora_core.config import ModelConfig

SHA256_RE = re.compile(r"^[0-9a-f]{64}$")
MAX_LABELS = 32
MAX_URI_CHARS = 2048


@dataclass(frozen=True)
class RegisterRequest:
    adapter_id: str
    version: str
    storage_uri: str
    sha256: str
    base_model: str
    tenant: str
    labels: Mapping[str, str] = field(default_factory=dict)


def check_request(req: RegisterRequest, base_models: Mapping[str, ModelConfig]) -> None:
    """Raise InvalidArgument for a malformed request, before anything is fetched."""
    check_adapter_id(req.adapter_id)
    check_version(req.version)
    if not SHA256_RE.fullmatch(req.sha256):
        raise InvalidArgument("sha256 must be 64 lowercase hex digits (see `slora admin digest`)")
    if req.base_model not in base_models:
        raise InvalidArgument(
            f"unknown base model {shown(req.base_model)}; this control plane serves "
            f"{sorted(base_models)}"
        )
    check_name("tenant", req.tenant)
    if len(req.storage_uri) > MAX_URI_CHARS:
        raise InvalidArgument(f"storage_uri is {len(req.storage_uri)} chars; at most {MAX_URI_CHARS}")
    if len(req.labels) > MAX_LABELS or any(len(k) > 63 or len(v) > 256 for k, v in req.labels.items()):
        raise InvalidArgument(f"at most {MAX_LABELS} labels, keys up to 63 and values up to 256 chars")


def existing_version(session: Session, req: RegisterRequest) -> AdapterVersion | None:
    """The already registered row for this request, if any; raises when the request conflicts
    with what is registered (another tenant or base model, or the same version with other
    content)."""
    adapter = session.get(Adapter, req.adapter_id)
    if adapter is None:
        return None
    if (adapter.tenant, adapter.base_model) != (req.tenant, req.base_model):
        raise FailedPrecondition(
            f"adapter {req.adapter_id!r} belongs to tenant {adapter.tenant!r} on base model "
            f"{adapter.base_model!r}"
        )
    for row in adapter.versions:
        if row.version == req.version:
            if row.sha256 != req.sha256:
                raise AlreadyExists(
                    f"{req.adapter_id} {req.version} is registered with sha256 {row.sha256}; "
                    "register the new content as a new version"
                )
            return row
    return None


def fetch_and_validate(
    req: RegisterRequest, model: ModelConfig, storage: StorageConfig, max_rank: int
) -> AdapterSummary:
    """Download into a temporary folder (streamed, hashed on the way), compare digests, and
    validate one tensor at a time (`adapter_check`): memory stays bounded whatever the size.

    A weights file larger than an adapter of `model` at `max_rank` can be is refused before it
    is downloaded. Raises InvalidArgument (fetch, size, digest), AdapterFormatError or
    AdapterIncompatibleError."""
    limits = {CONFIG_FILE: MAX_CONFIG_BYTES, WEIGHTS_FILE: max_weights_bytes(model, max_rank)}
    with staging_dir() as tmp:
        digest = fetch_adapter(req.storage_uri, Path(tmp), storage, limits)
        if digest != req.sha256:
            raise InvalidArgument(f"sha256 mismatch: the files at {req.storage_uri} hash to {digest}")
        return validate_adapter_dir(Path(tmp), model, max_rank, req.storage_uri.rstrip("/"))


def insert_version(
    session: Session, req: RegisterRequest, adapter: AdapterSummary, actor: Principal
) -> AdapterVersion:
    """Insert (adapter and route if new,) the VALIDATED version and its audit event."""
    row = session.get(Adapter, req.adapter_id)
    if row is None:
        row = Adapter(adapter_id=req.adapter_id, tenant=req.tenant, base_model=req.base_model,
                      created_by=actor.actor)
        row.route = Route()
        session.add(row)
        session.flush()
    version = AdapterVersion(
        adapter_id=req.adapter_id,
        version=req.version,
        state=VersionState.VALIDATED,
        rank=int(adapter.rank),
        lora_alpha=float(adapter.lora_alpha),
        use_rslora=bool(adapter.use_rslora),
        target_modules=sorted(adapter.target_modules),
        num_bytes=int(adapter.num_bytes),
        sha256=req.sha256,
        storage_uri=req.storage_uri,
        labels=dict(req.labels),
        created_by=actor.actor,
    )
    session.add(version)
    session.flush()
    record_event(
        session, actor, "register", tenant=req.tenant, adapter_id=req.adapter_id,
        version=req.version,
        details={"sha256": req.sha256, "storage_uri": req.storage_uri, "rank": version.rank,
                 "base_model": req.base_model},
        revision_before=row.route.revision, revision_after=row.route.revision,
    )
    return version
