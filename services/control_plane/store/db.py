"""Engines and sessions for the registry database (SQLite embedded, PostgreSQL in production)."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

from sqlalchemy import Engine, create_engine, event
from sqlalchemy.orm import Session, sessionmaker
from sqlalchemy.pool import StaticPool

import services.control_plane
from services.control_plane.store.models import AuditEvent


def find_migrations_dir() -> Path:
    """The Alembic folder: inside the package in an installed wheel (setup.py maps the top-level
    migrations/ there), else the checkout's top-level migrations/ (source tree, editable)."""
    packaged = Path(services.control_plane.__file__).resolve().parent / "migrations"
    # alembic.ini, not the folder: a checkout can keep a stale __pycache__ where it once was.
    if (packaged / "alembic.ini").is_file():
        return packaged
    return packaged.parents[2] / "migrations"


MIGRATIONS_DIR = find_migrations_dir()


def make_engine(url: str, **kwargs: Any) -> Engine:
    """An engine for `url` with the settings the registry relies on.

    SQLite: foreign keys on, WAL for file databases, and every transaction opened with
    `BEGIN IMMEDIATE`, so that a read-then-write transaction holds the write lock from its first
    read and concurrent writers wait (busy timeout) instead of failing on a stale snapshot.
    """
    if not url.startswith("sqlite"):
        return create_engine(url, pool_pre_ping=True, **kwargs)
    connect_args = {"timeout": 30.0, "check_same_thread": False}
    if url in ("sqlite://", "sqlite:///:memory:"):
        kwargs.setdefault("poolclass", StaticPool)
    engine = create_engine(url, connect_args=connect_args, **kwargs)
    file_db = engine.url.database not in (None, "", ":memory:")

    @event.listens_for(engine, "connect")
    def _on_connect(dbapi_conn: Any, _record: Any) -> None:
        # Take transaction control away from pysqlite so the "begin" hook below decides.
        dbapi_conn.isolation_level = None
        cur = dbapi_conn.cursor()
        cur.execute("PRAGMA foreign_keys=ON")
        if file_db:
            cur.execute("PRAGMA journal_mode=WAL")
        cur.close()

    @event.listens_for(engine, "begin")
    def _on_begin(conn: Any) -> None:
        conn.exec_driver_sql("BEGIN IMMEDIATE")

    return engine


def forbid_audit_changes(session: Session, _flush_context: Any, _instances: Any) -> None:
    """Session hook: audit events are append-only; updating or deleting one is a bug."""
    for obj in (*session.dirty, *session.deleted):
        if isinstance(obj, AuditEvent):
            raise RuntimeError("audit events are append-only")


def make_session_factory(engine: Engine) -> sessionmaker[Session]:
    """Sessions that keep loaded objects usable after commit (they are converted to plain
    records right away) and refuse changes to the audit log."""
    factory = sessionmaker(engine, expire_on_commit=False)
    event.listen(factory, "before_flush", forbid_audit_changes)
    return factory


def alembic_config(url: str) -> Any:
    """An Alembic `Config` for the registry's migrations, targeting `url`."""
    from alembic.config import Config

    # stdout given explicitly: Alembic's default is the sys.stdout of its first import, which
    # may be a stream closed since (pytest's capture).
    cfg = Config(str(MIGRATIONS_DIR / "alembic.ini"), stdout=sys.stdout)
    cfg.set_main_option("script_location", str(MIGRATIONS_DIR))
    # ConfigParser interpolation would choke on '%' in URL-encoded passwords.
    cfg.set_main_option("sqlalchemy.url", url.replace("%", "%%"))
    return cfg


def upgrade(url: str, revision: str = "head") -> None:
    """Apply migrations up to `revision` (the only way the schema changes)."""
    from alembic import command

    command.upgrade(alembic_config(url), revision)


def migration_problem(url: str) -> str | None:
    """None when the database at `url` is at the migrations' head; else one line saying what is
    wrong and what to run (instead of a traceback from the first query of a missing table)."""
    from alembic.runtime.migration import MigrationContext
    from alembic.script import ScriptDirectory
    from sqlalchemy.exc import DBAPIError

    scripts = ScriptDirectory.from_config(alembic_config(url))
    head = scripts.get_current_head()
    engine = make_engine(url)
    try:
        with engine.connect() as conn:
            current = MigrationContext.configure(conn).get_current_revision()
    except DBAPIError as e:
        return f"cannot read the registry database: {str(e.orig).splitlines()[0]}"
    finally:
        engine.dispose()
    if current == head:
        return None
    if current is not None and current not in {r.revision for r in scripts.walk_revisions()}:
        return (f"the registry database is at migration {current}, which this slora does not "
                f"know (its newest is {head}): a newer slora migrated it")
    return (f"the registry database is at migration {current or 'none (empty)'}, this slora "
            f"needs {head}: run `slora control-plane --migrate-only` or start with --migrate")
