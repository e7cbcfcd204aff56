"""Why was this request slow? Plain sentences made of the facts in its audit events.

A pure function of one audit record and its events (no I/O): `explain(record, events)`.

Every event time is on one monotonic clock (the gateway and the engine share a process). For each
engine sequence (a "choice") the time from the gateway's `received` event to the sequence's end
is split into delays and service:

    delay   = received -> first scheduled      (gateway, then the engine queue, cut into
                                                 segments by each waiting_for_kv/slot event)
            + each preempted -> resumed interval
    service = the rest (prefill and decode on the engine)

The delays partition that time, so the ones named always add up to the total delay. Events from
the gateway carry no `choice`; engine events carry the choice they belong to.

`viewer_tenant` is set when a tenant reads its own request: other tenants' names and request ids
are replaced by counts and "another tenant", so one tenant never learns about another.

Rooms, by what they explain: `tracks` (events into one track per choice), `queue` (gateway and
queue waits), `preemption` (each preemption, its cause and cost), `request` (the whole request,
its overview and accounting, or its refusal), `viewpoint` (who reads it: redaction), `words`
(how times and counts are written), `delays` (the result's types).

Must not import: gateway.openai, gateway.admin
"""

from gateway.audit.explain.delays import Delay, Explanation
from gateway.audit.explain.queue import NEXT_STEP_S
from gateway.audit.explain.request import ENDINGS, REFUSALS, TRIVIAL_S, explain
from gateway.audit.explain.tracks import WAIT_KINDS, Ev, first, is_wait, normalise
from gateway.audit.explain.viewpoint import redact_events, redact_facts
from gateway.audit.explain.words import joined, offset, plural, seconds, sequence_name

__all__ = [
    "ENDINGS",
    "NEXT_STEP_S",
    "REFUSALS",
    "TRIVIAL_S",
    "WAIT_KINDS",
    "Delay",
    "Ev",
    "Explanation",
    "explain",
    "first",
    "is_wait",
    "joined",
    "normalise",
    "offset",
    "plural",
    "redact_events",
    "redact_facts",
    "seconds",
    "sequence_name",
]
