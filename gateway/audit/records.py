"""The audit records the OpenAI routes write: refused, invalid and finished requests, queued on
the audit writer (never failing the request). `plan` is a `gateway.openai.planning.Plan` and
`tracker` a `gateway.openai.tracking.Tracker`, read by attribute: audit does not import the
OpenAI room.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import AsyncIterator
from typing import Any

from aiohttp import web

from gateway.appkeys import (
    AUDIT,
    PRINCIPAL,
    RECEIVED,
    REQUEST_ID,
)
from gateway.audit import events as ev
from gateway.errors import (
    APIError,
)

log = logging.getLogger(__name__)


@contextlib.asynccontextmanager
async def auditing_invalid_requests(request: web.Request) -> AsyncIterator[None]:
    """Note when the handler started; a request refused while it is read and planned (bad
    JSON, unknown model, prompt too long, ...) gets a `rejected` audit record, reason
    `validation`."""
    request[RECEIVED] = (time.time(), time.monotonic())
    try:
        yield
    except (APIError, web.HTTPException) as error:
        if 400 <= error.status < 500:
            record_invalid_request(request, error)
        raise


def record_invalid_request(request: web.Request, error: APIError | web.HTTPException) -> None:
    received_at, received_mono = request[RECEIVED]
    principal = request[PRINCIPAL]
    message = error.message if isinstance(error, APIError) else error.reason
    reason = "scope" if error.status == 403 else "validation"  # a key's models scope
    record = {
        "id": request[REQUEST_ID],
        "tenant_id": getattr(principal.tenant, "id", None),
        "key_id": principal.key_id,
        "received_at": received_at,
        "finished_at": time.time(),
        "status": "rejected",
        "refusal_reason": reason,
        "error": message,
        "completion_tokens": 0,
    }
    events = [
        {"kind": ev.RECEIVED, "time": received_mono},
        {"kind": ev.REFUSED, "time": time.monotonic(), "reason": reason},
    ]
    submit_audit(request.app, record, events)


def base_record(plan: Any) -> dict[str, Any]:
    return {
        "id": plan.request_id,
        "tenant_id": getattr(plan.principal.tenant, "id", None),
        "key_id": plan.principal.key_id,
        "model": plan.model,
        "requested_priority": plan.requested_priority,
        "effective_priority": plan.priority,
        "received_at": plan.received_at,
        "prompt_tokens": plan.num_prompt_tokens,
    }


def refused_record(
    plan: Any, reason: str | None, error: APIError, refused_by: str | None = None
) -> dict[str, Any]:
    return {
        **base_record(plan),
        "status": "rejected",
        "refusal_reason": reason,
        "refused_by": refused_by,
        "error": error.message,
        "finished_at": time.time(),
        "completion_tokens": 0,
    }


def finished_record(tracker: Any) -> dict[str, Any]:
    preemptions = [e.get("mode") for e in tracker.events if e.get("kind") == ev.PREEMPTED]
    return {
        **base_record(tracker.plan),
        "status": tracker.status,
        "finish_reason": tracker.finish_reason(),
        "completion_tokens": tracker.total_output_tokens,
        "first_scheduled_at": tracker.first_scheduled_at,
        "first_token_at": tracker.first_token_at,
        "finished_at": time.time(),
        "queue_time_s": tracker.queue_time_s,
        "preempted_time_s": tracker.preempted_time_s(time.monotonic()),
        "num_preemptions_swap": preemptions.count("swap"),
        "num_preemptions_recompute": preemptions.count("recompute"),
        "error": tracker.error,
    }


def submit_audit(app: web.Application, record: dict[str, Any], events=()) -> None:
    writer = app.get(AUDIT)
    if writer is None:  # --no-audit
        return
    try:
        writer.submit(record, events)
    except Exception:  # the audit log must never fail a request
        log.warning("could not queue the audit record of %s", record.get("id"), exc_info=True)
