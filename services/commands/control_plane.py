"""`slora control-plane`: serve the admin API over the SQL adapter registry."""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
from pathlib import Path

from services.common.cluster_token import add_cluster_token_argument
from services.common.tls import add_tls_arguments, apply_tls_arguments

BOOTSTRAP_ENV = "SLORA_ADMIN_KEY"


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("control-plane", help="serve the adapter registry and admin API")
    p.add_argument("--db", default=os.environ.get("SLORA_DB_URL", "sqlite:///.slora/control-plane.db"),
                   help="SQLAlchemy URL (sqlite:///FILE or postgresql+psycopg://...); env SLORA_DB_URL")
    p.add_argument("--listen", default="127.0.0.1:50051", help="HOST:PORT to serve on")
    p.add_argument("--base-model", action="append", default=[], metavar="NAME=DIR",
                   help="a base model adapters may target: NAME and its HF directory (repeatable)")
    p.add_argument("--allowed-root", action="append", default=[], metavar="DIR",
                   help="file:// adapter URIs must lie inside one of these folders (repeatable)")
    p.add_argument("--s3-endpoint-url", default=os.environ.get("AWS_ENDPOINT_URL"),
                   help="S3-compatible endpoint for s3:// URIs; env AWS_ENDPOINT_URL")
    p.add_argument("--max-rank", type=int, default=64, help="the engines' LoRA rank limit")
    p.add_argument("--bootstrap-admin-key", default=os.environ.get(BOOTSTRAP_ENV),
                   help=f"make this token a working admin key at start-up; env {BOOTSTRAP_ENV}")
    add_cluster_token_argument(p, "workers and gateways must present it on PlacementService "
                                  "(open without one)")
    p.add_argument("--metrics-port", type=int, default=None,
                   help="Prometheus HTTP port (per-version evidence, canary analysis)")
    p.add_argument("--analyzer-tick", type=float, default=None, metavar="SECONDS",
                   help="how often the canary analyzer looks at running canaries (default 0.25)")
    p.add_argument("--migrate", action="store_true",
                   help="apply the Alembic migrations (upgrade head) before serving")
    p.add_argument("--migrate-only", action="store_true", help="apply the migrations and exit")
    add_tls_arguments(p)
    p.add_argument("--worker-auth", choices=("credential", "cluster-token"), default="credential",
                   help="what makes a process a worker on the placement stream: its own "
                        "credential (`slora worker-credential mint`; default) or, legacy and "
                        "insecure, the cluster token alone")
    p.set_defaults(func=run)
    register_credentials(sub)


def register_credentials(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("worker-credential",
                       help="mint, revoke or list worker credentials (run where the database is)")
    p.add_argument("action", choices=("mint", "revoke", "list"))
    p.add_argument("--db", default=os.environ.get("SLORA_DB_URL", "sqlite:///.slora/control-plane.db"),
                   help="SQLAlchemy URL of the registry; env SLORA_DB_URL")
    p.add_argument("--worker-id", default="", help="the worker the credential is bound to")
    p.add_argument("--token-env", default="", metavar="VAR",
                   help="mint: bind the token in this environment variable (32+ chars) instead "
                        "of a random one, for deployments that provision secrets themselves")
    p.add_argument("--base-model", default=None, metavar="NAME",
                   help="mint: bind the credential to this base model (a control plane's "
                        "--base-model name): the worker must serve a model with its config")
    p.set_defaults(func=run_credentials)


def run_credentials(args: argparse.Namespace) -> int:
    from services.common.errors import ServiceError

    try:
        return _credentials(args)
    except ServiceError as e:
        raise SystemExit(f"worker-credential {args.action}: {e}") from None


def _credentials(args: argparse.Namespace) -> int:
    from services.control_plane.domain.principal import SYSTEM
    from services.control_plane.store.db import make_engine, make_session_factory
    from services.control_plane.store.worker_credentials import (
        WorkerCredentials,
        mint_with_database,
    )

    if args.action == "list":
        engine = make_engine(args.db)
        for c in WorkerCredentials(make_session_factory(engine)).list():
            state = f"revoked {c.revoked_at:%Y-%m-%d %H:%M}" if c.revoked_at else "active"
            print(f"{c.worker_id}\t{state}\tminted {c.created_at:%Y-%m-%d %H:%M} by {c.created_by}")
        engine.dispose()
        return 0
    if not args.worker_id:
        raise SystemExit(f"worker-credential {args.action}: --worker-id is required")
    if args.action == "revoke":
        engine = make_engine(args.db)
        WorkerCredentials(make_session_factory(engine)).revoke(args.worker_id, SYSTEM)
        engine.dispose()
        print(f"revoked the credential of {args.worker_id}")
        return 0
    token = os.environ.get(args.token_env, "") if args.token_env else None
    if args.token_env and not token:
        raise SystemExit(f"--token-env {args.token_env}: the variable is empty or unset")
    minted = mint_with_database(args.db, args.worker_id, token, args.base_model)
    # The token itself goes to stdout (and nowhere else): give it to the worker as
    # SLORA_WORKER_CREDENTIAL. A provisioned token is not echoed.
    print(minted if token is None else f"bound the token in ${args.token_env} to {args.worker_id}")
    return 0


def parse_base_models(specs: list[str]) -> dict[str, Path]:
    models: dict[str, Path] = {}
    for spec in specs:
        name, sep, path = spec.partition("=")
        if not sep or not name or not path:
            raise SystemExit(f"--base-model {spec!r}: expected NAME=DIR")
        models[name] = Path(path)
    return models


def run(args: argparse.Namespace) -> int:
    from services.control_plane.api.server import ControlPlaneConfig, serve
    from services.control_plane.store.db import upgrade
    from services.control_plane.store.storage import StorageConfig

    apply_tls_arguments(args)
    _ensure_sqlite_dir(args.db)
    if not args.migrate_only:
        refusal = _refusal(args)
        if refusal:  # one line, before logging is set up (no migration chatter around it)
            raise SystemExit(f"slora control-plane: {refusal}")
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if args.migrate_only:
        upgrade(args.db)
        return 0
    s3_options = {"endpoint_url": args.s3_endpoint_url} if args.s3_endpoint_url else {}
    config = ControlPlaneConfig(
        db_url=args.db,
        listen=args.listen,
        base_models=parse_base_models(args.base_model),
        storage=StorageConfig(tuple(Path(r) for r in args.allowed_root), s3_options),
        max_rank=args.max_rank,
        bootstrap_admin_key=args.bootstrap_admin_key,
        migrate=args.migrate,
        metrics_port=args.metrics_port,
        cluster_token=args.cluster_token or None,
        worker_auth=args.worker_auth,
        **({"analyzer_tick_s": args.analyzer_tick} if args.analyzer_tick else {}),
    )
    asyncio.run(serve(config))
    return 0


def _refusal(args: argparse.Namespace) -> str | None:
    """Why the control plane cannot start with these settings (short admin key, database not
    migrated), or None."""
    from services.control_plane.store.db import migration_problem
    from services.control_plane.store.keys import MIN_BOOTSTRAP_TOKEN_CHARS

    key = args.bootstrap_admin_key
    if key and len(key) < MIN_BOOTSTRAP_TOKEN_CHARS:
        return (f"the bootstrap admin key ({BOOTSTRAP_ENV} or --bootstrap-admin-key) has "
                f"{len(key)} chars; it needs {MIN_BOOTSTRAP_TOKEN_CHARS}+")
    return None if args.migrate else migration_problem(args.db)


def _ensure_sqlite_dir(url: str) -> None:
    # The embedded default lives under .slora/, which a fresh checkout does not have yet.
    prefix = "sqlite:///"
    if url.startswith(prefix) and url[len(prefix):] not in ("", ":memory:"):
        Path(url[len(prefix):]).parent.mkdir(parents=True, exist_ok=True)
