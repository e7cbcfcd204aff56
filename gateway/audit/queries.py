"""The queries behind `/admin/requests` and `/v1/requests/{id}`: pages of audit records with
filters and cursors, one record with its events, and pruning by age.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from datetime import datetime, timedelta, timezone
from typing import Any

from pydantic import BaseModel, ConfigDict, Field
from sqlalchemy import and_, delete, or_, select
from sqlalchemy.ext.asyncio import AsyncSession

from gateway.models import (
    AuditEvent,
    AuditRecord,
    utcnow,
)


class AuditRecordOut(BaseModel):
    model_config = ConfigDict(from_attributes=True)

    id: str
    tenant_id: int | None
    key_id: int | None
    model: str | None
    requested_priority: int | None
    effective_priority: int | None
    received_at: datetime
    first_scheduled_at: datetime | None
    first_token_at: datetime | None
    finished_at: datetime | None
    queue_time_s: float | None
    preempted_time_s: float
    num_preemptions_swap: int
    num_preemptions_recompute: int
    status: str
    finish_reason: str | None
    prompt_tokens: int | None
    completion_tokens: int | None
    refusal_reason: str | None
    refused_by: str | None = Field(
        None, description='the limit that refused it: "tenant", "key 7", "tenant model <name>"'
    )
    error: str | None


class AuditEventOut(BaseModel):
    model_config = ConfigDict(from_attributes=True)

    seq: int
    kind: str
    time: float
    data: dict[str, Any]


class RequestPage(BaseModel):
    items: list[AuditRecordOut]
    next_cursor: str | None  # pass back as `cursor` for the next (older) page


class RequestDetail(BaseModel):
    record: AuditRecordOut
    events: list[AuditEventOut]  # ordered by seq


MAX_PAGE_SIZE = 1000


# A page's end: the last record's receipt time (microseconds since 1970, UTC) and its id. Every
# text of this form is a position (the schema's pattern says exactly what is accepted).
CURSOR_PATTERN = r"^[0-9]{1,17}_[A-Za-z0-9_.-]{1,128}$"
EPOCH = datetime(1970, 1, 1, tzinfo=timezone.utc)


def encode_cursor(record: AuditRecordOut) -> str:
    micros = (record.received_at - EPOCH) // timedelta(microseconds=1)
    return f"{micros}_{record.id}"


def decode_cursor(cursor: str) -> tuple[datetime, str]:
    """ValueError when the cursor does not have the form `encode_cursor` gives."""
    if not re.fullmatch(CURSOR_PATTERN, cursor):
        raise ValueError("invalid cursor")
    micros, _, request_id = cursor.partition("_")
    return EPOCH + timedelta(microseconds=int(micros)), request_id


async def list_requests(
    session: AsyncSession,
    *,
    tenant_id: int | None = None,
    status: str | Sequence[str] | None = None,
    priority: int | None = None,
    received_after: datetime | None = None,
    received_before: datetime | None = None,
    min_queue_time_s: float | None = None,
    preempted_only: bool = False,
    cursor: str | None = None,
    limit: int = 50,
) -> RequestPage:
    """Newest first. `priority` is the effective priority; the time range is
    `received_after <= received_at < received_before`."""
    conditions = _request_filters(
        tenant_id, status, priority, received_after, received_before, min_queue_time_s
    )
    if preempted_only:
        total = AuditRecord.num_preemptions_swap + AuditRecord.num_preemptions_recompute
        conditions.append(total > 0)
    if cursor is not None:
        conditions.append(_older_than(*decode_cursor(cursor)))
    limit = max(1, min(limit, MAX_PAGE_SIZE))
    query = (
        select(AuditRecord)
        .where(*conditions)
        .order_by(AuditRecord.received_at.desc(), AuditRecord.id.desc())
        .limit(limit + 1)
    )
    rows = [AuditRecordOut.model_validate(row) for row in await session.scalars(query)]
    next_cursor = encode_cursor(rows[limit - 1]) if len(rows) > limit else None
    return RequestPage(items=rows[:limit], next_cursor=next_cursor)


def _request_filters(
    tenant_id: int | None,
    status: str | Sequence[str] | None,
    priority: int | None,
    received_after: datetime | None,
    received_before: datetime | None,
    min_queue_time_s: float | None,
) -> list[Any]:
    conditions: list[Any] = []
    if tenant_id is not None:
        conditions.append(AuditRecord.tenant_id == tenant_id)
    if isinstance(status, str):
        conditions.append(AuditRecord.status == status)
    elif status is not None:
        conditions.append(AuditRecord.status.in_(list(status)))
    if priority is not None:
        conditions.append(AuditRecord.effective_priority == priority)
    if received_after is not None:
        conditions.append(AuditRecord.received_at >= received_after)
    if received_before is not None:
        conditions.append(AuditRecord.received_at < received_before)
    if min_queue_time_s is not None:
        conditions.append(AuditRecord.queue_time_s >= min_queue_time_s)
    return conditions


def _older_than(received_at: datetime, request_id: str) -> Any:
    return or_(
        AuditRecord.received_at < received_at,
        and_(AuditRecord.received_at == received_at, AuditRecord.id < request_id),
    )


async def get_request(
    session: AsyncSession, request_id: str, *, tenant_id: int | None = None
) -> RequestDetail | None:
    """The record and its events, or None; with `tenant_id`, None unless it is that tenant's."""
    record = await session.get(AuditRecord, request_id)
    if record is None or (tenant_id is not None and record.tenant_id != tenant_id):
        return None
    events = await session.scalars(
        select(AuditEvent).where(AuditEvent.request_id == request_id).order_by(AuditEvent.seq)
    )
    return RequestDetail(
        record=AuditRecordOut.model_validate(record),
        events=[AuditEventOut.model_validate(event) for event in events],
    )


async def prune(
    session: AsyncSession, older_than_days: float, *, now: datetime | None = None
) -> int:
    """Delete records received more than `older_than_days` ago, with their events; returns the
    number of records deleted. The caller commits."""
    cutoff = (now or utcnow()) - timedelta(days=older_than_days)
    old_ids = select(AuditRecord.id).where(AuditRecord.received_at < cutoff)
    await session.execute(delete(AuditEvent).where(AuditEvent.request_id.in_(old_ids)))
    result = await session.execute(delete(AuditRecord).where(AuditRecord.received_at < cutoff))
    return result.rowcount
