"""Worker credentials bound to a base model: a worker must announce that model's config digest.

Revision ID: 0004
Revises: 0003
Create Date: 2026-12-03 15:00:00.000000
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = '0004'
down_revision: str | None = '0003'
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    with op.batch_alter_table('worker_credentials') as batch:
        batch.add_column(sa.Column('base_model', sa.String(length=128), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table('worker_credentials') as batch:
        batch.drop_column('base_model')
