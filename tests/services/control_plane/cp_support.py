"""Helpers of the control-plane tests (used by conftest.py and the test modules): PostgreSQL
schemas, table dumps, PEFT adapters saved by real peft, and the admin server running on its own
event-loop thread."""

from __future__ import annotations

import asyncio
import os
import secrets
import subprocess
import threading
from pathlib import Path
from typing import Any

import grpc
import sqlalchemy as sa
import torch

from services.control_plane.api.client import AdminClient
from services.control_plane.api.server import ControlPlane, ControlPlaneConfig, build_server
from services.control_plane.store.db import make_engine, make_session_factory, upgrade
from services.control_plane.store.models import Base
from services.control_plane.store.storage import StorageConfig

PG_URL = os.environ.get("SLORA_TEST_PG_URL", "postgresql+psycopg://postgres@127.0.0.1:5432/test")
ADMIN_TOKEN = "test-bootstrap-admin-token-0123456789"
BASE = "tiny-llama"
MAX_RANK = 8
BACKENDS = ["sqlite", "postgresql"]
HF_CONFIG: dict[str, Any] = dict(
    hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
    num_key_value_heads=2, vocab_size=64, max_position_embeddings=64,
)


# ---- databases ------------------------------------------------------------------------------

def pg_reachable() -> bool:
    engine = sa.create_engine(PG_URL)
    try:
        with engine.connect():
            return True
    except sa.exc.OperationalError:
        return False
    finally:
        engine.dispose()


def start_postgres() -> bool:
    """Start the local cluster when it is down (trust auth on 127.0.0.1); True if reachable."""
    if pg_reachable():
        return True
    versions = sorted(os.listdir("/etc/postgresql")) if os.path.isdir("/etc/postgresql") else []
    if versions:
        subprocess.run(["pg_ctlcluster", "--skip-systemctl-redirect", versions[-1], "main",
                        "start"], check=False, capture_output=True, timeout=60)
    return pg_reachable()


def create_pg_schema() -> tuple[str, str]:
    """A new empty schema and a URL whose connections use it: every test database is its own
    schema, so parallel runs never see each other's rows."""
    schema = f"cp_{secrets.token_hex(6)}"
    _pg_execute(f"CREATE SCHEMA {schema}")
    return schema, f"{PG_URL}?options=-csearch_path%3D{schema}"


def drop_pg_schema(schema: str) -> None:
    _pg_execute(f"DROP SCHEMA IF EXISTS {schema} CASCADE")


def _pg_execute(sql: str) -> None:
    engine = sa.create_engine(PG_URL)
    with engine.begin() as conn:
        conn.exec_driver_sql(sql)
    engine.dispose()


def dump(engine: sa.Engine) -> dict[str, list[dict[str, Any]]]:
    """Every row of every registry table, in a stable order (for before/after comparisons)."""
    out = {}
    with engine.connect() as conn:
        for table in Base.metadata.sorted_tables:
            rows = conn.execute(sa.select(table)).mappings().all()
            out[table.name] = sorted((dict(r) for r in rows), key=repr)
    return out


# ---- adapters -------------------------------------------------------------------------------

def make_peft_adapter(path: Path, seed: int, hf_overrides: dict[str, Any] | None = None,
                      **lora: Any) -> Path:
    """Save an adapter with peft itself (random non-zero A and B) for a tiny Llama."""
    from peft import LoraConfig, get_peft_model
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    base = LlamaForCausalLM(LlamaConfig(**{**HF_CONFIG, **(hf_overrides or {})}))
    lora = {"r": 4, "lora_alpha": 8, "target_modules": ["q_proj", "v_proj", "down_proj"], **lora}
    get_peft_model(base, LoraConfig(init_lora_weights=False, **lora)).save_pretrained(str(path))
    return path


def file_uri(path: Path) -> str:
    return f"file://{path}"


# ---- a running server -----------------------------------------------------------------------

class RunningPlane:
    """The admin server on its own event-loop thread, and a client holding the admin key."""

    def __init__(self, config: ControlPlaneConfig) -> None:
        self.engine = make_engine(config.db_url)
        self.sessions = make_session_factory(self.engine)
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True)
        self._thread.start()
        self.plane: ControlPlane = self._run(self._start(config))
        self.target = f"127.0.0.1:{self.plane.port}"
        self.channel = grpc.insecure_channel(self.target)
        self.admin = AdminClient(self.channel, ADMIN_TOKEN)

    def _run(self, coro: Any) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result(timeout=60)

    async def _start(self, config: ControlPlaneConfig) -> ControlPlane:
        plane = await build_server(config, self.sessions)
        await plane.server.start()
        return plane

    def client(self, token: str) -> AdminClient:
        return AdminClient(self.channel, token)

    def dump(self) -> dict[str, list[dict[str, Any]]]:
        return dump(self.engine)

    def close(self) -> None:
        self.channel.close()
        self._run(self.plane.stop(0))
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=10)
        self._loop.close()
        self.engine.dispose()


def start_plane(db_url: str, base_model_dir: Path, roots: tuple[Path, ...],
                s3_options: dict[str, Any] | None = None) -> RunningPlane:
    """Migrate `db_url` to head and serve it on a free loopback port."""
    upgrade(db_url)
    config = ControlPlaneConfig(
        db_url=db_url, listen="127.0.0.1:0", base_models={BASE: base_model_dir},
        storage=StorageConfig(allowed_roots=roots, s3_options=s3_options or {}),
        max_rank=MAX_RANK, bootstrap_admin_key=ADMIN_TOKEN,
    )
    return RunningPlane(config)


# ---- gRPC clients ---------------------------------------------------------------------------

# What grpc.aio's client puts in place of the server's status when a write it had in flight
# fails because the server had just ended the call (grpc/grpc#36066, still in grpcio 1.85): a
# worker that keeps sending while it is refused may read INTERNAL instead of PERMISSION_DENIED.
# No server of ours sends these details (the control plane's INTERNAL says "internal error: ...").
LOST_STATUS_DETAILS = "Internal error from Core"


def status_lost(exc: grpc.aio.AioRpcError) -> bool:
    """True when the client lost the server's status to one of its own writes (above)."""
    return exc.code() == grpc.StatusCode.INTERNAL and exc.details() == LOST_STATUS_DETAILS
