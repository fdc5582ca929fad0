"""Canary policies (per adapter, changed under the route's etag) and the canary analyzer's
persisted state (current window, last decision).

Revision ID: 0002
Revises: 0001
Create Date: 2026-11-29 11:18:39.105637
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = '0002'
down_revision: str | None = '0001'
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_table('canary_analyses',
    sa.Column('adapter_id', sa.String(length=128), nullable=False),
    sa.Column('canary_version', sa.String(length=64), nullable=True),
    sa.Column('route_revision', sa.BigInteger(), nullable=False),
    sa.Column('window_started_at', sa.DateTime(timezone=True), nullable=False),
    sa.Column('windows_passed', sa.Integer(), nullable=False),
    sa.Column('last_decision', sa.String(length=16), nullable=True),
    sa.Column('last_version', sa.String(length=64), nullable=True),
    sa.Column('last_decision_at', sa.DateTime(timezone=True), nullable=True),
    sa.Column('last_reason', sa.Text(), nullable=False),
    sa.Column('last_details', sa.JSON(), nullable=False),
    sa.Column('revision', sa.BigInteger(), nullable=False),
    sa.ForeignKeyConstraint(['adapter_id'], ['adapters.adapter_id'], name=op.f('fk_canary_analyses_adapter_id_adapters')),
    sa.PrimaryKeyConstraint('adapter_id', name=op.f('pk_canary_analyses'))
    )
    op.create_table('canary_policies',
    sa.Column('adapter_id', sa.String(length=128), nullable=False),
    sa.Column('window_s', sa.Float(), nullable=False),
    sa.Column('min_requests', sa.Integer(), nullable=False),
    sa.Column('min_feedback', sa.Integer(), nullable=False),
    sa.Column('max_error_rate_increase', sa.Float(), nullable=True),
    sa.Column('max_ttft_ratio', sa.Float(), nullable=True),
    sa.Column('max_tpot_ratio', sa.Float(), nullable=True),
    sa.Column('max_feedback_drop', sa.Float(), nullable=True),
    sa.Column('steps', sa.JSON(), nullable=False),
    sa.Column('updated_at', sa.DateTime(timezone=True), nullable=False),
    sa.Column('updated_by', sa.String(length=128), nullable=False),
    sa.ForeignKeyConstraint(['adapter_id'], ['adapters.adapter_id'], name=op.f('fk_canary_policies_adapter_id_adapters')),
    sa.PrimaryKeyConstraint('adapter_id', name=op.f('pk_canary_policies'))
    )


def downgrade() -> None:
    op.drop_table('canary_policies')
    op.drop_table('canary_analyses')
