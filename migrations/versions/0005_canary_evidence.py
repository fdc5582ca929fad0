"""Durable canary evidence: per-window evidence of each version, and the workers' counters it
was taken up to, so a restarted control plane resumes a canary's analysis.

Revision ID: 0005
Revises: 0004
Create Date: 2026-12-03 15:10:00.000000
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = '0005'
down_revision: str | None = '0004'
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_table('canary_evidence',
    sa.Column('adapter_id', sa.String(length=128), nullable=False),
    sa.Column('route_revision', sa.BigInteger(), nullable=False),
    sa.Column('version', sa.String(length=64), nullable=False),
    sa.Column('evidence', sa.JSON(), nullable=False),
    sa.Column('updated_at', sa.DateTime(timezone=True), nullable=False),
    sa.ForeignKeyConstraint(['adapter_id'], ['adapters.adapter_id'],
                            name=op.f('fk_canary_evidence_adapter_id_adapters')),
    sa.PrimaryKeyConstraint('adapter_id', 'route_revision', 'version',
                            name=op.f('pk_canary_evidence'))
    )
    op.create_table('evidence_checkpoints',
    sa.Column('worker_id', sa.String(length=128), nullable=False),
    sa.Column('started_at_ms', sa.BigInteger(), nullable=False),
    sa.Column('counters', sa.JSON(), nullable=False),
    sa.PrimaryKeyConstraint('worker_id', name=op.f('pk_evidence_checkpoints'))
    )


def downgrade() -> None:
    op.drop_table('evidence_checkpoints')
    op.drop_table('canary_evidence')
