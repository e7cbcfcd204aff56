"""The audit log over HTTP: `GET /admin/requests` (filters, cursor pagination),
`GET /admin/requests/{request_id}` (record, events and explanation) and, for a tenant with its
own key, `GET /v1/requests/{request_id}` (its own requests only; another tenant's is a 404, and
other tenants' names and request ids are redacted from the explanation and the events)."""

from __future__ import annotations

import asyncio
import re
from datetime import datetime
from typing import Annotated, Any

from aiohttp import web
from pydantic import (
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    ValidationError,
    field_validator,
)

from gateway.appkeys import AUDIT, PRINCIPAL, SESSIONMAKER
from gateway.audit.explain import explain, redact_events
from gateway.audit.ids import record_id_of
from gateway.audit.queries import (
    CURSOR_PATTERN,
    MAX_PAGE_SIZE,
    AuditEventOut,
    AuditRecordOut,
    RequestDetail,
    RequestPage,
    get_request,
    list_requests,
)
from gateway.errors import APIError, bad_request

READ_THROUGH_TIMEOUT_S = 5.0
STATUSES = ("finished", "aborted", "cancelled", "error", "rejected")
STATUS_LIST_PATTERN = f"^({'|'.join(STATUSES)})(,({'|'.join(STATUSES)}))*$"
INT32_MIN, INT32_MAX = -(2**31), 2**31 - 1  # the id and priority columns' range
# A body id (`chatcmpl-<hex>`) or an x-request-id; anything else is a 404 before SQL sees it.
REQUEST_ID_PATTERN = re.compile(r"[A-Za-z0-9_.-]{1,128}")
REQUEST_ID_SCHEMA = {"type": "string", "pattern": f"^{REQUEST_ID_PATTERN.pattern}$"}


NUMBER = re.compile(r"[-+]?[0-9]*\.?[0-9]*([eE][-+]?[0-9]+)?")


def not_a_number(value: Any) -> Any:
    """The document says `format: date-time`; pydantic alone would read "0.5" as a timestamp."""
    if isinstance(value, str) and NUMBER.fullmatch(value.strip()):
        raise ValueError("Input should be an ISO 8601 date-time")
    return value


IsoDateTime = Annotated[datetime, BeforeValidator(not_a_number)]


class RequestQuery(BaseModel):
    """Filters of `GET /admin/requests` (query string); newest first."""

    model_config = ConfigDict(extra="forbid")

    tenant_id: int | None = Field(
        None, ge=0, le=INT32_MAX, description="only this tenant's requests"
    )
    tenant: str | None = Field(
        None, max_length=64, pattern=r"^[^\x00]*$", description="only this tenant's, by name"
    )
    status: str | None = Field(
        None,
        pattern=STATUS_LIST_PATTERN,
        description=f"comma-separated statuses: {', '.join(STATUSES)}",
    )
    priority: int | None = Field(None, ge=INT32_MIN, le=INT32_MAX, description="effective priority")
    received_after: IsoDateTime | None = Field(None, description="ISO 8601, inclusive")
    received_before: IsoDateTime | None = Field(None, description="ISO 8601, exclusive")
    min_queue_time_s: float | None = Field(None, ge=0, description="queued at least this long")
    preempted_only: bool = Field(False, description="only requests preempted at least once")
    cursor: str | None = Field(
        None,
        pattern=CURSOR_PATTERN,
        description="`next_cursor` of the previous page: <microseconds since 1970>_<request id>",
    )
    limit: int = Field(50, ge=1, le=MAX_PAGE_SIZE)

    @field_validator("status")
    @classmethod
    def known_statuses(cls, value: str | None) -> str | None:
        if value is not None:
            unknown = set(value.split(",")) - set(STATUSES)
            if unknown:
                raise ValueError(f"unknown status {sorted(unknown)}; use {', '.join(STATUSES)}")
        return value


class DelayOut(BaseModel):
    cause: str = Field(
        description="gateway | queue | waiting_for_kv | waiting_for_slot | preempted"
    )
    start_s: float = Field(description="seconds after the request was received")
    duration_s: float
    sentence: str
    choice: int | None
    facts: dict[str, Any]


class RequestDetailOut(BaseModel):
    record: AuditRecordOut
    events: list[AuditEventOut]
    explanation: list[str] = Field(description="plain sentences: where the time went and why")
    delays: list[DelayOut] = Field(description="every delay named; they add up to total_delay_s")
    total_time_s: float | None
    total_delay_s: float
    service_time_s: float | None
    timeline_url: str = Field(description="the request's timeline page (HTML), same key")


def query_of(request: web.Request) -> RequestQuery:
    try:
        return RequestQuery.model_validate(dict(request.query))
    except ValidationError as error:
        problem = error.errors(include_url=False)[0]
        name = ".".join(str(part) for part in problem["loc"]) or None
        raise bad_request(
            f"Invalid query parameter '{name}': {problem['msg']}", param=name
        ) from None


async def list_requests_handler(request: web.Request) -> web.Response:
    query = query_of(request)
    async with request.config_dict[SESSIONMAKER]() as session:
        tenant_id = await tenant_filter(session, query)
        try:
            page = await list_requests(
                session,
                tenant_id=tenant_id,
                status=query.status.split(",") if query.status else None,
                priority=query.priority,
                received_after=query.received_after,
                received_before=query.received_before,
                min_queue_time_s=query.min_queue_time_s,
                preempted_only=query.preempted_only,
                cursor=query.cursor,
                limit=query.limit,
            )
        except ValueError as error:  # a cursor we did not make
            raise bad_request(str(error), param="cursor") from None
    return web.json_response(text=page.model_dump_json())


async def tenant_filter(session, query: RequestQuery) -> int | None:
    if query.tenant is None:
        return query.tenant_id
    from gateway.tenancy.tenants import TenantNotFound, get_tenant_by_name

    try:
        tenant = await get_tenant_by_name(session, query.tenant)
    except TenantNotFound:
        return -1  # matches nothing: an empty page, as for an unknown tenant_id
    if query.tenant_id is not None and query.tenant_id != tenant.id:
        return -1
    return tenant.id


async def get_request_handler(request: web.Request) -> web.Response:
    detail = await request_detail(request, request.match_info["request_id"], None, None)
    return web.json_response(text=detail.model_dump_json())


async def own_request(request: web.Request) -> web.Response:
    """`GET /v1/requests/{request_id}` with a tenant key: the tenant's own requests only."""
    tenant = request[PRINCIPAL].tenant
    request_id = request.match_info["request_id"]
    detail = await request_detail(request, request_id, tenant.id, tenant.name)
    return web.json_response(text=detail.model_dump_json())


async def request_detail(
    request: web.Request, given_id: str, tenant_id: int | None, viewer: str | None
) -> RequestDetailOut:
    """The record of a body id (`cmpl-…`, `chatcmpl-…`) or an x-request-id, explained."""
    detail = await find_detail(request, given_id, tenant_id)
    return with_explanation(detail.record, detail.events, viewer)


async def find_detail(request: web.Request, given_id: str, tenant_id: int | None) -> RequestDetail:
    """The record and events of a body id or an x-request-id (404 otherwise). Read through the
    audit writer: a record still queued is written first, so it is readable as soon as the
    response has ended."""
    if not REQUEST_ID_PATTERN.fullmatch(given_id):
        raise APIError(404, f"No request {given_id!r} in the audit log.", code="not_found")
    request_id = record_id_of(given_id)
    detail = await read_detail(request, request_id, tenant_id)
    if detail is None and await flushed_pending(request):
        detail = await read_detail(request, request_id, tenant_id)
    if detail is None:
        raise APIError(404, f"No request {given_id!r} in the audit log.", code="not_found")
    return detail


async def read_detail(request: web.Request, request_id: str, tenant_id: int | None):
    async with request.config_dict[SESSIONMAKER]() as session:
        return await get_request(session, request_id, tenant_id=tenant_id)


async def flushed_pending(request: web.Request) -> bool:
    """Whether the audit writer had queued records and has now written (or spooled) them."""
    writer = request.config_dict.get(AUDIT)
    if writer is None or writer.num_pending == 0:
        return False
    try:
        await asyncio.wait_for(writer.flush(), READ_THROUGH_TIMEOUT_S)
    except (asyncio.TimeoutError, RuntimeError):
        return False
    return True


def with_explanation(
    record: AuditRecordOut, events: list[AuditEventOut], viewer: str | None
) -> RequestDetailOut:
    stored = [event.model_dump() for event in events]
    explanation = explain(record.model_dump(), stored, viewer_tenant=viewer)
    shown = stored if viewer is None else redact_events(stored, viewer)
    return RequestDetailOut(
        record=record,
        events=[AuditEventOut.model_validate(event) for event in shown],
        explanation=explanation.sentences,
        delays=[
            DelayOut.model_validate(delay, from_attributes=True) for delay in explanation.delays
        ],
        total_time_s=explanation.total_time_s,
        total_delay_s=explanation.total_delay_s,
        service_time_s=explanation.service_time_s,
        timeline_url=timeline_url(record.id, viewer),
    )


def timeline_url(request_id: str, viewer: str | None) -> str:
    """The timeline page of a record: under `/v1` for its tenant, `/admin` for an operator."""
    return f"{'/admin' if viewer is None else '/v1'}/requests/{request_id}/timeline"


__all__ = ["RequestDetailOut", "RequestPage", "RequestQuery"]
