"""Before the first step: time in the gateway, then in the engine queue, cut into segments by
each `waiting_*` event the scheduler recorded, each named by the event that began it."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from gateway.audit import events as ev
from gateway.audit.explain.delays import Delay
from gateway.audit.explain.tracks import Track, first, is_wait
from gateway.audit.explain.viewpoint import Viewpoint
from gateway.audit.explain.words import joined, plural, seconds

NEXT_STEP_S = 0.25  # longer, with nobody ahead, is no longer just "the next step"


def queue_delays(view: Viewpoint, seq: Track, start: float, stop: float) -> list[Delay]:
    """[start, stop) cut at each wait event; each piece named by the event that began it."""
    queued = first(seq.events, ev.QUEUED)
    delays = []
    gateway_end = min(queued.time, stop) if queued else stop
    if gateway_end > start or queued is None:
        delays.append(gateway_delay(seq, start, gateway_end))
    if queued is None:
        return delays
    cuts = [(queued.time, "queue", queued.data)]
    cuts += [(e.time, e.kind, e.data) for e in seq.events if is_wait(e.kind)]
    cuts = [cut for cut in cuts if cut[0] < stop] or cuts[:1]
    for (begin, kind, facts), (end, _, _) in zip(cuts, cuts[1:] + [(stop, "", {})]):
        delays.append(segment(view, seq, kind, facts, begin, max(end, begin)))
    return delays


def gateway_delay(seq: Track, start: float, end: float) -> Delay:
    duration = max(end - start, 0.0)
    sentence = (
        f"spent {seconds(duration)} in the gateway (reading and tokenizing the prompt, "
        "checking rate limits) before joining the engine queue"
    )
    return Delay("gateway", seq.at(start), duration, sentence, seq.choice)


def segment(view: Viewpoint, seq: Track, kind: str, facts, begin: float, end: float) -> Delay:
    duration = end - begin
    if kind == "queue":
        sentence = queue_sentence(view, facts, duration)
    else:
        sentence = wait_sentence(view, kind, facts, duration)
    shown = {k: v for k, v in facts.items() if k != "choice"}
    return Delay(kind, seq.at(begin), duration, sentence, seq.choice, view.redact(shown))


def queue_sentence(view: Viewpoint, facts: Mapping[str, Any], duration: float) -> str:
    num_ahead = int(facts.get("num_ahead", 0))
    num_running = facts.get("num_running")
    running = f" ({num_running} running)" if num_running is not None else ""
    if num_ahead == 0 and duration < NEXT_STEP_S:
        return f"waited {seconds(duration)} for the engine's next step{running}"
    if num_ahead == 0:  # the scheduler recorded no wait: a full step, or later arrivals
        return (
            f"waited {seconds(duration)} in the queue for a place in a step with no request "
            f"ahead of it on arrival{running}"
        )
    ahead = plural(num_ahead, "request")
    rank = view.rank_text(facts.get("ahead_priorities") or [])
    tenants = facts.get("ahead_tenants") or []
    source = f" from {view.tenants_text(tenants)}" if tenants else ""
    return f"waited {seconds(duration)} in the queue behind {ahead}{rank}{source}{running}"


def wait_sentence(view: Viewpoint, kind: str, facts: Mapping[str, Any], duration: float) -> str:
    if kind == ev.WAITING_FOR_KV:
        needed, free = facts.get("blocks_needed"), facts.get("blocks_free")
        return (
            f"waited {seconds(duration)} for KV cache: needed {plural(needed or 0, 'block')}"
            f" with {free} free"
        )
    if kind == ev.WAITING_FOR_SLOT:
        running = facts.get("num_running")
        return f"waited {seconds(duration)} for a running slot: all {running} were busy"
    if kind == ev.WAITING_BEHIND:  # the line stopped at `by`
        who = view.request_text(facts.get("by") or "", facts.get("by_tenant"))
        return (
            f"waited {seconds(duration)} behind {who} (priority {facts.get('by_priority')}), "
            "which could not be scheduled yet"
        )
    if kind == ev.WAITING_FOR_BUDGET:  # the step's tokens ran out
        return (
            f"waited {seconds(duration)} for room in a step: the "
            f"{facts.get('max_batch_tokens')}-token step budget was used by "
            f"{plural(facts.get('num_scheduled') or 0, 'sequence')}"
        )
    if kind == ev.WAITING_FOR_BATCH:
        return batch_wait_sentence(facts, duration)
    shown = joined(f"{k} {v}" for k, v in facts.items() if k != "choice")
    reason = kind.removeprefix("waiting_").replace("_", " ")
    return f"waited {seconds(duration)} {reason}" + (f" ({shown})" if shown else "")


def batch_wait_sentence(facts: Mapping[str, Any], duration: float) -> str:
    if facts.get("num_running"):
        return f"waited {seconds(duration)} for the running batch to finish"
    return (
        f"waited {seconds(duration)} for a batch to form: up to "
        f"{facts.get('window_s')} s for {facts.get('batch_size')} requests"
    )
