"""Keys that live like credentials: a name, an expiry, rotation with a grace period, scopes
(models, endpoints) and limits of their own; tenants get per-model limits; a refusal's audit
record names the limit that refused it (`refused_by`).

Revision ID: 0004
Revises: 0003
Create Date: 2026-11-26
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects import postgresql

revision: str = "0004"
down_revision: str | None = "0003"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

JsonDocument = sa.JSON().with_variant(postgresql.JSONB(astext_type=sa.Text()), "postgresql")
KEY_COLUMNS = ("name", "expires_at", "grace_ends_at", "replaced_by_id", "lineage_id", "models",
               "endpoints", "limits")  # fmt: skip


def upgrade() -> None:
    with op.batch_alter_table("api_keys") as batch:
        batch.add_column(sa.Column("name", sa.String(length=128), nullable=True))
        batch.add_column(sa.Column("expires_at", sa.DateTime(timezone=True), nullable=True))
        batch.add_column(sa.Column("grace_ends_at", sa.DateTime(timezone=True), nullable=True))
        batch.add_column(sa.Column("replaced_by_id", sa.Integer(), nullable=True))
        batch.add_column(sa.Column("lineage_id", sa.Integer(), nullable=True))
        batch.add_column(sa.Column("models", JsonDocument, nullable=True))
        batch.add_column(sa.Column("endpoints", JsonDocument, nullable=True))
        batch.add_column(sa.Column("limits", JsonDocument, nullable=True))
    with op.batch_alter_table("tenants") as batch:
        batch.add_column(sa.Column("model_limits", JsonDocument, nullable=True))
    with op.batch_alter_table("audit_records") as batch:
        batch.add_column(sa.Column("refused_by", sa.String(length=300), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("audit_records") as batch:
        batch.drop_column("refused_by")
    with op.batch_alter_table("tenants") as batch:
        batch.drop_column("model_limits")
    with op.batch_alter_table("api_keys") as batch:
        for column in reversed(KEY_COLUMNS):
            batch.drop_column(column)
