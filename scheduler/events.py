"""Typed delay events: each decision that delays or moves a request, with the facts behind it."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

QUEUED = "queued"
WAITING_FOR_KV = "waiting_for_kv"
WAITING_FOR_SLOT = "waiting_for_slot"
WAITING_BEHIND = "waiting_behind"  # the head of the line could not get in; it waits behind it
WAITING_FOR_BUDGET = "waiting_for_budget"  # the step's token budget ran out before its turn
WAITING_FOR_BATCH = "waiting_for_batch"  # dynamic batching: the batch has not formed yet
SCHEDULED = "scheduled"
PREFILL_CHUNK = "prefill_chunk"  # a later chunk of the prompt (the first is SCHEDULED)
PREEMPTED = "preempted"
SWAPPED_IN = "swapped_in"
RECOMPUTE_STARTED = "recompute_started"
RESUMED = "resumed"
FINISHED = "finished"
ABORTED = "aborted"
PRIORITY_AGED = "priority_aged"


@dataclass(slots=True)
class Event:
    kind: str
    time: float
    data: dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return {"kind": self.kind, "time": self.time, **self.data}


def emit(request: Any, kind: str, now: float | None = None, **data: Any) -> Event:
    event = Event(kind, time.monotonic() if now is None else now, data)
    request.events.append(event)
    return event
