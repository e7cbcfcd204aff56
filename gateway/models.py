"""SQL schema: tenants, their API keys, and the audit log (one row per request plus its events).

Times are timezone-aware UTC datetimes on both SQLite and PostgreSQL. Priorities follow the
scheduler: a lower number is more urgent.
"""

from __future__ import annotations

from datetime import datetime, timezone
from typing import Any

from sqlalchemy import (
    JSON,
    BigInteger,
    DateTime,
    Dialect,
    Float,
    ForeignKey,
    Index,
    Integer,
    MetaData,
    String,
    Text,
    TypeDecorator,
    UniqueConstraint,
)
from sqlalchemy.dialects import postgresql
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column

NAMING_CONVENTION = {
    "ix": "ix_%(table_name)s_%(column_0_N_name)s",
    "uq": "uq_%(table_name)s_%(column_0_N_name)s",
    "ck": "ck_%(table_name)s_%(constraint_name)s",
    "fk": "fk_%(table_name)s_%(column_0_name)s_%(referred_table_name)s",
    "pk": "pk_%(table_name)s",
}

# JSONB on PostgreSQL (indexable, compact), plain JSON text on SQLite.
JsonDocument = JSON().with_variant(postgresql.JSONB(), "postgresql")
# 64-bit on PostgreSQL; SQLite only auto-increments a column declared exactly INTEGER.
BigId = BigInteger().with_variant(Integer(), "sqlite")


def utcnow() -> datetime:
    return datetime.now(timezone.utc)


class UtcDateTime(TypeDecorator[datetime]):
    """Stores UTC, returns aware UTC datetimes; naive inputs are taken to be UTC already."""

    impl = DateTime(timezone=True)
    cache_ok = True

    def process_bind_param(self, value: datetime | None, dialect: Dialect) -> datetime | None:
        if value is None:
            return None
        if value.tzinfo is None:
            return value.replace(tzinfo=timezone.utc)
        return value.astimezone(timezone.utc)

    def process_result_value(self, value: datetime | None, dialect: Dialect) -> datetime | None:
        if value is None:
            return None
        if value.tzinfo is None:  # SQLite keeps no offset
            return value.replace(tzinfo=timezone.utc)
        return value.astimezone(timezone.utc)


class Base(DeclarativeBase):
    metadata = MetaData(naming_convention=NAMING_CONVENTION)


class Tenant(Base):
    __tablename__ = "tenants"

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    name: Mapped[str] = mapped_column(String(64), unique=True)
    default_priority: Mapped[int] = mapped_column(Integer, default=0)
    max_priority: Mapped[int] = mapped_column(Integer, default=0)  # most urgent allowed
    weight: Mapped[float] = mapped_column(Float, default=1.0)
    # Limits (gateway.tenancy.limits.LIMIT_FIELDS): NULL means unlimited.
    rpm: Mapped[int | None] = mapped_column(Integer)
    burst: Mapped[int] = mapped_column(Integer, default=0, server_default="0")  # extra on rpm
    tpm: Mapped[int | None] = mapped_column(BigInteger)
    max_concurrency: Mapped[int | None] = mapped_column(Integer)
    daily_token_quota: Mapped[int | None] = mapped_column(BigInteger)
    monthly_token_quota: Mapped[int | None] = mapped_column(BigInteger)
    max_grammar_bytes: Mapped[int | None] = mapped_column(BigInteger)  # one compiled grammar
    # {served model name: {limit name: value}}: limits per model, nested under the tenant's
    model_limits: Mapped[dict[str, dict[str, int]] | None] = mapped_column(JsonDocument)
    enabled: Mapped[bool] = mapped_column(default=True)
    created_at: Mapped[datetime] = mapped_column(UtcDateTime, default=utcnow)
    updated_at: Mapped[datetime] = mapped_column(UtcDateTime, default=utcnow, onupdate=utcnow)


class ApiKey(Base):
    __tablename__ = "api_keys"

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    tenant_id: Mapped[int] = mapped_column(ForeignKey("tenants.id", ondelete="CASCADE"), index=True)
    prefix: Mapped[str] = mapped_column(String(16))  # shown to people, e.g. "cvy_ab12"
    key_hash: Mapped[str] = mapped_column(String(64), unique=True)  # HMAC-SHA256, hex
    created_at: Mapped[datetime] = mapped_column(UtcDateTime, default=utcnow)
    last_used_at: Mapped[datetime | None] = mapped_column(UtcDateTime)
    revoked_at: Mapped[datetime | None] = mapped_column(UtcDateTime)
    name: Mapped[str | None] = mapped_column(String(128))
    expires_at: Mapped[datetime | None] = mapped_column(UtcDateTime)  # refused from then on
    grace_ends_at: Mapped[datetime | None] = mapped_column(UtcDateTime)  # rotated: works until
    replaced_by_id: Mapped[int | None] = mapped_column(Integer)  # rotated: its successor
    # the first key of its rotations (NULL: itself): its limits' counters are shared by them all
    lineage_id: Mapped[int | None] = mapped_column(Integer)
    # Scopes (NULL: every model, every inference endpoint) and the key's own limits
    # ({limit name: value}, nested under its tenant's; NULL: none of its own).
    models: Mapped[list[str] | None] = mapped_column(JsonDocument)
    endpoints: Mapped[list[str] | None] = mapped_column(JsonDocument)
    limits: Mapped[dict[str, int] | None] = mapped_column(JsonDocument)


class AuditRecord(Base):
    """One row per request: what it asked for, what happened, and where its time went.

    tenant_id and key_id carry no foreign keys: the log outlives deleted tenants, and a write
    must never fail because of one.
    """

    __tablename__ = "audit_records"

    id: Mapped[str] = mapped_column(String(64), primary_key=True)  # the request id
    tenant_id: Mapped[int | None] = mapped_column(Integer)
    key_id: Mapped[int | None] = mapped_column(Integer)
    model: Mapped[str | None] = mapped_column(String(256))
    requested_priority: Mapped[int | None] = mapped_column(Integer)
    effective_priority: Mapped[int | None] = mapped_column(Integer)
    received_at: Mapped[datetime] = mapped_column(UtcDateTime)
    first_scheduled_at: Mapped[datetime | None] = mapped_column(UtcDateTime)
    first_token_at: Mapped[datetime | None] = mapped_column(UtcDateTime)
    finished_at: Mapped[datetime | None] = mapped_column(UtcDateTime)
    queue_time_s: Mapped[float | None] = mapped_column(Float)
    preempted_time_s: Mapped[float] = mapped_column(Float, default=0.0)
    num_preemptions_swap: Mapped[int] = mapped_column(Integer, default=0)
    num_preemptions_recompute: Mapped[int] = mapped_column(Integer, default=0)
    status: Mapped[str] = mapped_column(String(32))
    finish_reason: Mapped[str | None] = mapped_column(String(32))
    prompt_tokens: Mapped[int | None] = mapped_column(Integer)
    completion_tokens: Mapped[int | None] = mapped_column(Integer)
    refusal_reason: Mapped[str | None] = mapped_column(String(32))  # rate_limit, quota, ...
    refused_by: Mapped[str | None] = mapped_column(String(300))  # "key 7 rpm", "tenant tpm", ...
    error: Mapped[str | None] = mapped_column(Text)

    __table_args__ = (
        Index("ix_audit_records_received_at_id", "received_at", "id"),
        Index("ix_audit_records_tenant_id_received_at", "tenant_id", "received_at"),
        Index("ix_audit_records_status_received_at", "status", "received_at"),
        Index(
            "ix_audit_records_effective_priority_received_at", "effective_priority", "received_at"
        ),
    )


class AuditEvent(Base):
    """One scheduling or gateway event of a request, in the order it happened (`seq`)."""

    __tablename__ = "audit_events"

    id: Mapped[int] = mapped_column(BigId, primary_key=True)
    request_id: Mapped[str] = mapped_column(ForeignKey("audit_records.id", ondelete="CASCADE"))
    seq: Mapped[int] = mapped_column(Integer)
    kind: Mapped[str] = mapped_column(String(64))
    time: Mapped[float] = mapped_column(Float)  # seconds, on the producer's clock
    data: Mapped[dict[str, Any]] = mapped_column(JsonDocument, default=dict)

    __table_args__ = (UniqueConstraint("request_id", "seq"),)


AUDIT_RECORD_COLUMNS = frozenset(AuditRecord.__table__.columns.keys())
AUDIT_TIME_COLUMNS = frozenset(
    name
    for name, column in AuditRecord.__table__.columns.items()
    if isinstance(column.type, UtcDateTime)
)
