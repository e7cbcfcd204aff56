"""An admitted request's life: engine capacity, the tenant's limits (prompt + max_tokens
reserved), what it used, and on the way out the refund, the lease release and the audit record.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, field
from typing import Any

from aiohttp import web

from gateway.appkeys import (
    AUDIT,
    METRICS,
    RATE_LIMITER,
    SERVING_STATE,
    SETTINGS,
)
from gateway.audit import events as ev
from gateway.audit.records import finished_record, refused_record, submit_audit
from gateway.errors import (
    APIError,
    overloaded,
)
from gateway.openai.planning import Plan
from gateway.tenancy.admission import refusal_error, request_limits, start_lease_renewal
from gateway.tenancy.limit_scopes import RequestLimits
from gateway.tenancy.ratelimit import Admission


# ==== admission, accounting and audit =========================================================
@dataclass
class Tracker:
    """What one admitted HTTP request has used so far, for the refund and the audit record."""

    plan: Plan
    limits: RequestLimits
    admission: Admission
    num_output_tokens: dict[int, int] = field(default_factory=dict)  # per choice
    finish_reasons: dict[int, str | None] = field(default_factory=dict)
    events: list[dict[str, Any]] = field(default_factory=list)
    first_token_at: float | None = None
    first_scheduled_at: float | None = None
    first_scheduled_mono: float | None = None
    queue_time_s: float | None = None
    status: str = "finished"
    error: str | None = None
    cancelled: bool = False  # by an operator (POST /admin/requests/{id}/cancel)
    keep_events: bool = True  # False when audit is off
    last_token_mono: dict[int, float] = field(default_factory=dict)  # per choice
    inter_token_s: list[float] = field(default_factory=list)  # gaps between a choice's tokens

    def __post_init__(self) -> None:
        self.events.append({"kind": ev.RECEIVED, "time": self.plan.received_mono})
        admitted = {"kind": ev.ADMITTED, "time": time.monotonic()}
        admitted["reserved_tokens"] = self.admission.reserved_tokens
        if self.admission.degraded:
            admitted["rate_limits_unchecked"] = True  # Redis unreachable, failing open
        self.events.append(admitted)
        if self.plan.grammar is not None:  # constrained: how long its grammar took
            self.events.append(self.plan.grammar.event())

    def observe(self, choice: int, output) -> None:
        self.num_output_tokens[choice] = output.num_output_tokens
        if output.new_token_ids:
            self._note_token(choice)
            self._note_progress(choice, len(output.new_token_ids))
        if output.finished:
            self.finish_reasons[choice] = output.finish_reason
            if output.finish_reason == "abort":  # e.g. the drain timeout of a shutdown
                self.status = "aborted"
        if self.keep_events:
            self.events += [{**event.to_dict(), "choice": choice} for event in output.events]
        self._note_scheduling(output)

    def _note_token(self, choice: int) -> None:
        now = time.monotonic()
        if self.first_token_at is None:
            self.first_token_at = self.plan.mono_to_wall(now)
            self.events.append({"kind": ev.FIRST_TOKEN, "time": now})
        last = self.last_token_mono.get(choice)
        if last is not None:
            self.inter_token_s.append(now - last)
        self.last_token_mono[choice] = now

    def _note_progress(self, choice: int, num_new: int) -> None:
        """Every DECODE_PROGRESS_EVERY tokens of a choice, its count and the time: the decode
        rate along the way, for the timeline."""
        count, every = self.num_output_tokens[choice], ev.DECODE_PROGRESS_EVERY
        if self.keep_events and count // every > (count - num_new) // every:
            self.events.append(
                {
                    "kind": ev.DECODE_PROGRESS,
                    "time": time.monotonic(),
                    "choice": choice,
                    "num_output_tokens": count,
                }
            )

    def _note_scheduling(self, output) -> None:
        """The earliest first scheduling of any choice (clock: the engine's monotonic one)."""
        scheduled = output.first_scheduled_time
        if scheduled is None:
            return
        if self.first_scheduled_mono is not None and scheduled >= self.first_scheduled_mono:
            return
        self.first_scheduled_mono = scheduled
        self.queue_time_s = scheduled - output.arrival_time
        self.first_scheduled_at = self.plan.mono_to_wall(scheduled)

    def cancel(self, engine) -> None:
        """Abort every choice in the engine; the response ends with finish_reason "abort"."""
        self.cancelled = True
        self.events.append({"kind": ev.CANCELLED, "time": time.monotonic()})
        for choice in range(self.plan.num_choices):
            engine.abort(self.plan.sequence_id(choice))

    def preempted_time_s(self, end: float) -> float:
        """Seconds the choices spent preempted (preempted -> resumed, or -> `end`), summed."""
        total, since = 0.0, {}
        for event in sorted(self.events, key=lambda e: e["time"]):
            choice = event.get("choice")
            if event["kind"] == ev.PREEMPTED:
                since[choice] = event["time"]
            elif event["kind"] in (ev.RESUMED, ev.FINISHED, ev.ABORTED) and choice in since:
                total += event["time"] - since.pop(choice)
        return total + sum(end - start for start in since.values())

    @property
    def total_output_tokens(self) -> int:
        return sum(self.num_output_tokens.values())

    @property
    def used_tokens(self) -> int:
        return self.plan.num_prompt_tokens + self.total_output_tokens

    def finish_reason(self) -> str | None:
        reasons = set(self.finish_reasons.values())
        return reasons.pop() if len(reasons) == 1 else ("mixed" if reasons else None)


def check_capacity(app: web.Application, num_sequences: int) -> None:
    """503 while draining or when the engine's line is already full (beyond a lone request)."""
    state, settings = app[SERVING_STATE], app[SETTINGS]
    if state.is_draining:
        raise overloaded("The server is shutting down; retry on another replica.", 1.0)
    capacity = settings.max_num_seqs + settings.max_waiting_requests
    # A lone request always gets in, however many sequences it has (at most MAX_PROMPTS * MAX_N):
    # refusing it would refuse it forever, since retrying cannot make it smaller.
    is_alone = state.num_inflight_sequences == 0
    if not is_alone and state.num_inflight_sequences + num_sequences > capacity:
        raise overloaded(
            f"The server is overloaded ({state.num_inflight_sequences} sequences in flight). "
            "Please retry shortly.",
            1.0,
        )


@contextlib.contextmanager
def holding_capacity(app: web.Application, plan: Plan) -> Iterator[None]:
    """Count the plan's sequences as in flight (503 when they do not fit) until it ends."""
    try:
        check_capacity(app, plan.num_choices)
    except APIError as error:
        reason = "draining" if app[SERVING_STATE].is_draining else "overloaded"
        record_refusal(app, plan, reason, error)
        raise
    state = app[SERVING_STATE]
    state.num_inflight_sequences += plan.num_choices
    try:
        yield
    finally:
        state.num_inflight_sequences -= plan.num_choices


async def admit_or_refuse(app: web.Application, plan: Plan, limits: RequestLimits) -> Admission:
    """Reserve prompt + max tokens (and a concurrency lease) under every limit of the tenant, its
    key and the model."""
    admission = await app[RATE_LIMITER].admit(
        limits, plan.request_id, plan.num_prompt_tokens, plan.num_reserved_output_tokens
    )
    if not admission.allowed:
        error = refusal_error(admission)
        record_refusal(app, plan, admission.reason, error, admission.refused_by)
        raise error
    return admission


@contextlib.asynccontextmanager
async def admitted(request: web.Request, plan: Plan) -> AsyncIterator[Tracker]:
    """Capacity and rate limits first; on the way out, refund, release and audit."""
    app = request.app
    with holding_capacity(app, plan):
        limits = request_limits(plan.principal, plan.model)
        tracker = Tracker(plan, limits, await admit_or_refuse(app, plan, limits))
        tracker.keep_events = app.get(AUDIT) is not None
        renewal = start_lease_renewal(app, limits, plan.request_id)
        app[SERVING_STATE].inflight[plan.request_id] = tracker
        try:
            yield tracker
        except asyncio.CancelledError:
            tracker.status = "aborted"
            raise
        except Exception as error:
            tracker.status, tracker.error = "error", f"{type(error).__name__}: {error}"
            raise
        finally:
            app[SERVING_STATE].inflight.pop(plan.request_id, None)
            if renewal is not None:
                renewal.cancel()
            await asyncio.shield(settle(app, tracker))


async def settle(app: web.Application, tracker: Tracker) -> None:
    """Refund the unused reservation and write the audit record."""
    reserved = tracker.admission.reserved_tokens
    await app[RATE_LIMITER].complete(
        tracker.limits, tracker.plan.request_id, reserved, tracker.used_tokens
    )
    if tracker.cancelled:
        tracker.status = "cancelled"
    tracker.events.append(
        {"kind": ev.COMPLETED, "time": time.monotonic(), "status": tracker.status}
    )
    app[METRICS].observe_finished(tracker)
    submit_audit(app, finished_record(tracker), tracker.events)


def record_refusal(
    app: web.Application,
    plan: Plan,
    reason: str | None,
    error: APIError,
    refused_by: str | None = None,
) -> None:
    """Audit record (with its `received` and `refused` events) and metrics of a refusal;
    `refused_by`: the limit set that refused ("tenant", "key 7", "tenant model m")."""
    refused = {"kind": ev.REFUSED, "time": time.monotonic(), "reason": reason}
    refused |= {"status": error.status} | ({"refused_by": refused_by} if refused_by else {})
    events = [{"kind": ev.RECEIVED, "time": plan.received_mono}, refused]
    app[METRICS].observe_refused(plan.principal.tenant.name, reason or "unknown")
    submit_audit(app, refused_record(plan, reason, error, refused_by), events)
