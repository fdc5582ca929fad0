"""Initial registry schema: tenants, API keys, adapters, versions, routes, audit events.

Revision ID: 0001
Revises: 
Create Date: 2026-11-29 10:52:02.963464
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = '0001'
down_revision: str | None = None
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_table('audit_events',
    sa.Column('id', sa.BigInteger().with_variant(sa.Integer(), 'sqlite'), autoincrement=True, nullable=False),
    sa.Column('at', sa.DateTime(timezone=True), nullable=False),
    sa.Column('actor', sa.String(length=128), nullable=False),
    sa.Column('action', sa.String(length=32), nullable=False),
    sa.Column('tenant', sa.String(length=128), nullable=True),
    sa.Column('adapter_id', sa.String(length=128), nullable=True),
    sa.Column('version', sa.String(length=64), nullable=True),
    sa.Column('reason', sa.Text(), nullable=False),
    sa.Column('details', sa.JSON(), nullable=False),
    sa.Column('revision_before', sa.BigInteger(), nullable=True),
    sa.Column('revision_after', sa.BigInteger(), nullable=True),
    sa.PrimaryKeyConstraint('id', name=op.f('pk_audit_events'))
    )
    with op.batch_alter_table('audit_events', schema=None) as batch_op:
        batch_op.create_index('ix_audit_events_adapter_id_id', ['adapter_id', 'id'], unique=False)
        batch_op.create_index(batch_op.f('ix_audit_events_tenant'), ['tenant'], unique=False)

    op.create_table('tenants',
    sa.Column('name', sa.String(length=128), nullable=False),
    sa.Column('created_at', sa.DateTime(timezone=True), nullable=False),
    sa.Column('created_by', sa.String(length=128), nullable=False),
    sa.PrimaryKeyConstraint('name', name=op.f('pk_tenants'))
    )
    op.create_table('adapters',
    sa.Column('adapter_id', sa.String(length=128), nullable=False),
    sa.Column('tenant', sa.String(length=128), nullable=False),
    sa.Column('base_model', sa.String(length=128), nullable=False),
    sa.Column('created_at', sa.DateTime(timezone=True), nullable=False),
    sa.Column('created_by', sa.String(length=128), nullable=False),
    sa.ForeignKeyConstraint(['tenant'], ['tenants.name'], name=op.f('fk_adapters_tenant_tenants')),
    sa.PrimaryKeyConstraint('adapter_id', name=op.f('pk_adapters'))
    )
    with op.batch_alter_table('adapters', schema=None) as batch_op:
        batch_op.create_index(batch_op.f('ix_adapters_tenant'), ['tenant'], unique=False)

    op.create_table('api_keys',
    sa.Column('key_id', sa.String(length=64), nullable=False),
    sa.Column('token_sha256', sa.String(length=64), nullable=False),
    sa.Column('scope', sa.String(length=16), nullable=False),
    sa.Column('tenant', sa.String(length=128), nullable=True),
    sa.Column('name', sa.String(length=128), nullable=False),
    sa.Column('created_at', sa.DateTime(timezone=True), nullable=False),
    sa.Column('created_by', sa.String(length=128), nullable=False),
    sa.Column('revoked_at', sa.DateTime(timezone=True), nullable=True),
    sa.CheckConstraint("(scope = 'admin') = (tenant IS NULL)", name=op.f('ck_api_keys_tenant_iff_tenant_scope')),
    sa.CheckConstraint("scope IN ('admin', 'tenant')", name=op.f('ck_api_keys_scope')),
    sa.ForeignKeyConstraint(['tenant'], ['tenants.name'], name=op.f('fk_api_keys_tenant_tenants')),
    sa.PrimaryKeyConstraint('key_id', name=op.f('pk_api_keys')),
    sa.UniqueConstraint('token_sha256', name=op.f('uq_api_keys_token_sha256'))
    )
    with op.batch_alter_table('api_keys', schema=None) as batch_op:
        batch_op.create_index(batch_op.f('ix_api_keys_tenant'), ['tenant'], unique=False)

    op.create_table('adapter_versions',
    sa.Column('id', sa.BigInteger().with_variant(sa.Integer(), 'sqlite'), autoincrement=True, nullable=False),
    sa.Column('adapter_id', sa.String(length=128), nullable=False),
    sa.Column('version', sa.String(length=64), nullable=False),
    sa.Column('state', sa.Enum('registered', 'validated', 'canary', 'stable', 'retired', 'failed', 'rolled_back', name='version_state', native_enum=False, create_constraint=True, length=16), nullable=False),
    sa.Column('rank', sa.Integer(), nullable=False),
    sa.Column('lora_alpha', sa.Float(), nullable=False),
    sa.Column('use_rslora', sa.Boolean(), nullable=False),
    sa.Column('target_modules', sa.JSON(), nullable=False),
    sa.Column('num_bytes', sa.BigInteger(), nullable=False),
    sa.Column('sha256', sa.String(length=64), nullable=False),
    sa.Column('storage_uri', sa.Text(), nullable=False),
    sa.Column('labels', sa.JSON(), nullable=False),
    sa.Column('created_at', sa.DateTime(timezone=True), nullable=False),
    sa.Column('created_by', sa.String(length=128), nullable=False),
    sa.ForeignKeyConstraint(['adapter_id'], ['adapters.adapter_id'], name=op.f('fk_adapter_versions_adapter_id_adapters')),
    sa.PrimaryKeyConstraint('id', name=op.f('pk_adapter_versions')),
    sa.UniqueConstraint('adapter_id', 'version', name='uq_adapter_versions_adapter_version')
    )
    op.create_table('routes',
    sa.Column('adapter_id', sa.String(length=128), nullable=False),
    sa.Column('stable_version', sa.String(length=64), nullable=True),
    sa.Column('canary_version', sa.String(length=64), nullable=True),
    sa.Column('traffic_ratio', sa.Float(), nullable=False),
    sa.Column('fallback_version', sa.String(length=64), nullable=True),
    sa.Column('revision', sa.BigInteger(), nullable=False),
    sa.Column('updated_at', sa.DateTime(timezone=True), nullable=False),
    sa.CheckConstraint('traffic_ratio >= 0 AND traffic_ratio <= 1', name=op.f('ck_routes_traffic_ratio')),
    sa.ForeignKeyConstraint(['adapter_id'], ['adapters.adapter_id'], name=op.f('fk_routes_adapter_id_adapters')),
    sa.PrimaryKeyConstraint('adapter_id', name=op.f('pk_routes'))
    )


def downgrade() -> None:
    op.drop_table('routes')
    op.drop_table('adapter_versions')
    with op.batch_alter_table('api_keys', schema=None) as batch_op:
        batch_op.drop_index(batch_op.f('ix_api_keys_tenant'))

    op.drop_table('api_keys')
    with op.batch_alter_table('adapters', schema=None) as batch_op:
        batch_op.drop_index(batch_op.f('ix_adapters_tenant'))

    op.drop_table('adapters')
    op.drop_table('tenants')
    with op.batch_alter_table('audit_events', schema=None) as batch_op:
        batch_op.drop_index(batch_op.f('ix_audit_events_tenant'))
        batch_op.drop_index('ix_audit_events_adapter_id_id')

    op.drop_table('audit_events')
