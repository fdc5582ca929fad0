"""Worker credentials: each worker's own token (hashed), bound to its worker id, revocable.

Revision ID: 0003
Revises: 0002
Create Date: 2026-11-30 17:30:00.000000
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = '0003'
down_revision: str | None = '0002'
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_table('worker_credentials',
    sa.Column('worker_id', sa.String(length=128), nullable=False),
    sa.Column('token_sha256', sa.String(length=64), nullable=False),
    sa.Column('created_at', sa.DateTime(timezone=True), nullable=False),
    sa.Column('created_by', sa.String(length=128), nullable=False),
    sa.Column('revoked_at', sa.DateTime(timezone=True), nullable=True),
    sa.PrimaryKeyConstraint('worker_id', name=op.f('pk_worker_credentials')),
    sa.UniqueConstraint('token_sha256', name=op.f('uq_worker_credentials_token_sha256'))
    )


def downgrade() -> None:
    op.drop_table('worker_credentials')
