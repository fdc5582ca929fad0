"""Alembic environment for the control-plane registry (SQLite and PostgreSQL)."""

from __future__ import annotations

import os

from alembic import context
from sqlalchemy import Connection

from services.control_plane.store.db import make_engine
from services.control_plane.store.models import Base

config = context.config
target_metadata = Base.metadata


def database_url() -> str:
    """`-x db=URL` wins over SLORA_DB_URL, which wins over alembic.ini's sqlalchemy.url."""
    return (
        context.get_x_argument(as_dictionary=True).get("db")
        or os.environ.get("SLORA_DB_URL")
        or config.get_main_option("sqlalchemy.url")
        or ""
    )


def run_offline() -> None:
    context.configure(url=database_url(), target_metadata=target_metadata,
                      literal_binds=True, render_as_batch=True)
    with context.begin_transaction():
        context.run_migrations()


def run_online() -> None:
    connection = config.attributes.get("connection")
    if connection is not None:
        _run(connection)
        return
    engine = make_engine(database_url())
    try:
        with engine.connect() as conn:
            _run(conn)
    finally:
        engine.dispose()


def _run(connection: Connection) -> None:
    # Batch mode lets later migrations alter tables on SQLite (copy-and-move).
    context.configure(connection=connection, target_metadata=target_metadata,
                      render_as_batch=True, compare_type=True)
    with context.begin_transaction():
        context.run_migrations()


if context.is_offline_mode():
    run_offline()
else:
    run_online()
