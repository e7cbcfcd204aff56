"""Create tenants, API keys and the audit log (records and their events).

Revision ID: 0001
Revises:
Create Date: 2026-11-22
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects import postgresql

revision: str = "0001"
down_revision: str | None = None
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

Timestamp = sa.DateTime(timezone=True)  # gateway.models.UtcDateTime stores this type
JsonDocument = sa.JSON().with_variant(postgresql.JSONB(astext_type=sa.Text()), "postgresql")
BigId = sa.BigInteger().with_variant(sa.Integer(), "sqlite")


def upgrade() -> None:
    create_tenants()
    create_api_keys()
    create_audit_records()
    create_audit_events()


def downgrade() -> None:
    op.drop_table("audit_events")
    op.drop_table("audit_records")
    op.drop_table("api_keys")
    op.drop_table("tenants")


def create_tenants() -> None:
    op.create_table(
        "tenants",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("name", sa.String(length=64), nullable=False),
        sa.Column("default_priority", sa.Integer(), nullable=False),
        sa.Column("max_priority", sa.Integer(), nullable=False),
        sa.Column("weight", sa.Float(), nullable=False),
        sa.Column("rpm", sa.Integer(), nullable=True),
        sa.Column("tpm", sa.BigInteger(), nullable=True),
        sa.Column("max_concurrency", sa.Integer(), nullable=True),
        sa.Column("daily_token_quota", sa.BigInteger(), nullable=True),
        sa.Column("monthly_token_quota", sa.BigInteger(), nullable=True),
        sa.Column("enabled", sa.Boolean(), nullable=False),
        sa.Column("created_at", Timestamp, nullable=False),
        sa.Column("updated_at", Timestamp, nullable=False),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_tenants")),
        sa.UniqueConstraint("name", name=op.f("uq_tenants_name")),
    )


def create_api_keys() -> None:
    op.create_table(
        "api_keys",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("tenant_id", sa.Integer(), nullable=False),
        sa.Column("prefix", sa.String(length=16), nullable=False),
        sa.Column("key_hash", sa.String(length=64), nullable=False),
        sa.Column("created_at", Timestamp, nullable=False),
        sa.Column("last_used_at", Timestamp, nullable=True),
        sa.Column("revoked_at", Timestamp, nullable=True),
        sa.ForeignKeyConstraint(
            ["tenant_id"],
            ["tenants.id"],
            name=op.f("fk_api_keys_tenant_id_tenants"),
            ondelete="CASCADE",
        ),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_api_keys")),
        sa.UniqueConstraint("key_hash", name=op.f("uq_api_keys_key_hash")),
    )
    op.create_index(op.f("ix_api_keys_tenant_id"), "api_keys", ["tenant_id"])


def create_audit_records() -> None:
    op.create_table(
        "audit_records",
        sa.Column("id", sa.String(length=64), nullable=False),
        sa.Column("tenant_id", sa.Integer(), nullable=True),
        sa.Column("key_id", sa.Integer(), nullable=True),
        sa.Column("model", sa.String(length=256), nullable=True),
        sa.Column("requested_priority", sa.Integer(), nullable=True),
        sa.Column("effective_priority", sa.Integer(), nullable=True),
        sa.Column("received_at", Timestamp, nullable=False),
        sa.Column("first_scheduled_at", Timestamp, nullable=True),
        sa.Column("first_token_at", Timestamp, nullable=True),
        sa.Column("finished_at", Timestamp, nullable=True),
        sa.Column("queue_time_s", sa.Float(), nullable=True),
        sa.Column("preempted_time_s", sa.Float(), nullable=False),
        sa.Column("num_preemptions_swap", sa.Integer(), nullable=False),
        sa.Column("num_preemptions_recompute", sa.Integer(), nullable=False),
        sa.Column("status", sa.String(length=32), nullable=False),
        sa.Column("finish_reason", sa.String(length=32), nullable=True),
        sa.Column("prompt_tokens", sa.Integer(), nullable=True),
        sa.Column("completion_tokens", sa.Integer(), nullable=True),
        sa.Column("refusal_reason", sa.String(length=32), nullable=True),
        sa.Column("error", sa.Text(), nullable=True),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_audit_records")),
    )
    for columns in (
        ["received_at", "id"],
        ["tenant_id", "received_at"],
        ["status", "received_at"],
        ["effective_priority", "received_at"],
    ):
        op.create_index(f"ix_audit_records_{'_'.join(columns)}", "audit_records", columns)


def create_audit_events() -> None:
    op.create_table(
        "audit_events",
        sa.Column("id", BigId, nullable=False),
        sa.Column("request_id", sa.String(length=64), nullable=False),
        sa.Column("seq", sa.Integer(), nullable=False),
        sa.Column("kind", sa.String(length=64), nullable=False),
        sa.Column("time", sa.Float(), nullable=False),
        sa.Column("data", JsonDocument, nullable=False),
        sa.ForeignKeyConstraint(
            ["request_id"],
            ["audit_records.id"],
            name=op.f("fk_audit_events_request_id_audit_records"),
            ondelete="CASCADE",
        ),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_audit_events")),
        sa.UniqueConstraint("request_id", "seq", name=op.f("uq_audit_events_request_id_seq")),
    )
