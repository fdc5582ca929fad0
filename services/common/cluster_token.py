"""The cluster credential: one shared secret that workers and gateways present, as a bearer
token, on the control plane's PlacementService streams; and `bearer_token`, which every service
uses to read a bearer token (cluster token or API key) from call metadata.

Those streams are not for API keys (data-plane processes hold none), yet they must not be open
to whoever reaches the control plane's port: the routing stream carries API-key hashes and
accepts evidence and feedback reports that steer canary verdicts.
"""

from __future__ import annotations

import argparse
import hmac
import os
import secrets
from collections.abc import Iterable

CLUSTER_TOKEN_ENV = "SLORA_CLUSTER_TOKEN"


def new_cluster_token() -> str:
    """A fresh random cluster token (256 bits), for one stack."""
    return "slc_" + secrets.token_urlsafe(32)


def add_cluster_token_argument(parser: argparse.ArgumentParser, role: str) -> None:
    """`--cluster-token`, defaulting to $SLORA_CLUSTER_TOKEN ('' when unset). `role` says in
    the help what this process does with it."""
    parser.add_argument("--cluster-token", default=os.environ.get(CLUSTER_TOKEN_ENV, ""),
                        help=f"shared secret of the cluster: {role}; env {CLUSTER_TOKEN_ENV} "
                             "(prefer the env: arguments show in `ps`)")


def cluster_metadata(token: str) -> tuple[tuple[str, str], ...]:
    """Call metadata that presents `token` as a bearer token; none for an empty token."""
    return (("authorization", f"Bearer {token}"),) if token else ()


def bearer_token(metadata: Iterable[tuple[str, str | bytes]] | None) -> str:
    """The token of an `authorization: Bearer <token>` metadata entry, or ''."""
    for key, value in metadata or ():
        if key.lower() == "authorization":
            text = value.decode() if isinstance(value, bytes) else value
            scheme, _, token = text.partition(" ")
            return token.strip() if scheme.lower() == "bearer" else ""
    return ""


def token_matches(presented: str, expected: str) -> bool:
    """Constant-time comparison, so response timing does not leak the token's prefix."""
    return hmac.compare_digest(presented.encode(), expected.encode())
