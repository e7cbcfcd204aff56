"""The kinds of event in an audit trail, each declared once: the scheduler's own (from
`scheduler.events`, imported, never retyped) and the ones the gateway adds around them."""

from __future__ import annotations

from scheduler.events import (  # noqa: F401 (re-exported: the audit trail's engine kinds)
    ABORTED,
    FINISHED,
    PREEMPTED,
    PREFILL_CHUNK,
    PRIORITY_AGED,
    QUEUED,
    RECOMPUTE_STARTED,
    RESUMED,
    SCHEDULED,
    SWAPPED_IN,
    WAITING_BEHIND,
    WAITING_FOR_BATCH,
    WAITING_FOR_BUDGET,
    WAITING_FOR_KV,
    WAITING_FOR_SLOT,
)

RECEIVED = "received"  # the gateway read the request
ADMITTED = "admitted"  # capacity and the tenant's limits let it in
REFUSED = "refused"  # it got a 4xx/5xx before the engine saw it
GRAMMAR_PREPARED = "grammar_prepared"  # constrained: its grammar's kind, compile ms, cache hit
FIRST_TOKEN = "first_token"
DECODE_PROGRESS = "decode_progress"  # a choice's output count every DECODE_PROGRESS_EVERY tokens
DECODE_PROGRESS_EVERY = 32
CANCELLED = "cancelled"  # by an operator
COMPLETED = "completed"  # the gateway settled it (refund, audit record)
