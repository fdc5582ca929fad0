"""Data-plane identities: what a worker presents to the control plane.

A worker's credential (minted per worker id, see services/control_plane/store/worker_credentials.py)
comes from $SLORA_WORKER_CREDENTIAL, or from the file named by $SLORA_WORKER_CREDENTIAL_FILE (a
mounted Kubernetes Secret key); the placement stream presents it instead of the shared cluster
token, which alone no longer makes a process a worker. docs/security.md has the model.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Mapping
from pathlib import Path

from services.common.cluster_token import cluster_metadata

WORKER_CREDENTIAL_ENV = "SLORA_WORKER_CREDENTIAL"
WORKER_CREDENTIAL_FILE_ENV = "SLORA_WORKER_CREDENTIAL_FILE"


class CredentialFileError(ValueError):
    """The credential file is named but unusable; the message never holds the credential."""


def worker_credential(env: Mapping[str, str] = os.environ) -> str:
    """The worker's own credential: $SLORA_WORKER_CREDENTIAL, else the stripped content of
    $SLORA_WORKER_CREDENTIAL_FILE (read on each call, so a rotated Secret is picked up on the
    next reconnect), else "" (none configured). CredentialFileError when the file is missing,
    unreadable or empty."""
    direct = env.get(WORKER_CREDENTIAL_ENV, "")
    path = env.get(WORKER_CREDENTIAL_FILE_ENV, "")
    if direct or not path:
        return direct
    try:
        token = Path(path).read_text(encoding="utf-8").strip()
    except (OSError, UnicodeDecodeError) as e:
        reason = e.strerror if isinstance(e, OSError) and e.strerror else type(e).__name__
        raise CredentialFileError(
            f"{WORKER_CREDENTIAL_FILE_ENV}={path}: cannot read the worker credential "
            f"({reason})") from None
    if not token:
        raise CredentialFileError(f"{WORKER_CREDENTIAL_FILE_ENV}={path}: the file is empty")
    return token


def worker_metadata(cluster_token: str = "",
                    env: Mapping[str, str] = os.environ) -> tuple[tuple[str, str], ...]:
    """Metadata for the worker's placement stream: its own credential when it has one, else
    the cluster token (accepted only by control planes in the legacy cluster-token mode)."""
    return cluster_metadata(worker_credential(env) or cluster_token)


def config_digest(model_dir: Path) -> str:
    """sha256 of a base model's config.json as canonical JSON (sorted keys, no spaces), so a
    re-formatted file has the same digest and any changed value a different one. What binds a
    worker credential to its base model (docs/security.md)."""
    config = json.loads((model_dir / "config.json").read_text(encoding="utf-8"))
    canonical = json.dumps(config, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(canonical.encode("utf-8")).hexdigest()
