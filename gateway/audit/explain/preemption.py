"""Each preemption of a sequence: from `preempted` to `resumed` (or to its end), who caused it,
what it cost (blocks swapped to CPU and back, or tokens recomputed) and what it waited for
while out."""

from __future__ import annotations

from gateway.audit import events as ev
from gateway.audit.explain.delays import Delay
from gateway.audit.explain.tracks import Ev, Track, first, is_wait
from gateway.audit.explain.viewpoint import Viewpoint
from gateway.audit.explain.words import joined, offset, plural, seconds
from gateway.audit.ids import sequence_id


def preemption_delays(view: Viewpoint, seq: Track) -> list[Delay]:
    delays = []
    for index, event in enumerate(seq.events):
        if event.kind != ev.PREEMPTED:
            continue
        later = seq.events[index + 1 :]
        stop = next((i for i, e in enumerate(later) if e.kind == ev.RESUMED), None)
        end = later[stop].time if stop is not None else seq.end
        inside = later[:stop] if stop is not None else later
        delays.append(preemption(view, seq, event, inside, end, stop is not None))
    return delays


def preemption(
    view: Viewpoint, seq: Track, event: Ev, inside: list[Ev], end: float, resumed: bool
) -> Delay:
    facts = event.data
    mode, num_blocks = facts.get("mode"), facts.get("num_blocks", 0)
    duration = end - event.time
    sentence = f"preempted at {offset(seq.at(event.time))} {cause_text(view, seq, event)}; "
    sentence += preemption_cost(mode, num_blocks, inside)
    sentence += preemption_waits(inside)
    if resumed:
        sentence += f", resumed after {seconds(duration)}"
    else:
        sentence += f", and was still preempted {seconds(duration)} later when it ended"
    shown = view.redact({k: v for k, v in facts.items() if k != "choice"})
    return Delay(ev.PREEMPTED, seq.at(event.time), duration, sentence, seq.choice, shown)


def cause_text(view: Viewpoint, seq: Track, event: Ev) -> str:
    by, by_tenant = event.data.get("by", ""), event.data.get("by_tenant")
    if by and by == sequence_id(view.record.get("id"), seq.choice):
        return "to make room for itself: it needed another KV block and was the least urgent"
    who = view.request_text(by, by_tenant)
    details = [f"priority {event.data.get('by_priority')}"]
    if view.may_see(by_tenant):
        details.append(f"tenant {by_tenant}")
    return f"by {who} ({joined(details)})"


def preemption_cost(mode: str | None, num_blocks: int, inside: list[Ev]) -> str:
    blocks = plural(num_blocks, "KV block")
    if mode == "swap":
        swapped_in = first(inside, ev.SWAPPED_IN)
        back = " and back" if swapped_in else " (not yet back)"
        return f"{blocks} swapped to CPU{back}"
    recompute = first(inside, ev.RECOMPUTE_STARTED)
    if recompute is None:
        return f"its {blocks} were freed to be recomputed"
    num_tokens = recompute.data.get("num_tokens", 0)
    cached = recompute.data.get("num_cached_tokens", 0)
    from_cache = f" ({cached} found in the prefix cache)" if cached else ""
    return f"its {blocks} were freed and {plural(num_tokens, 'token')} recomputed{from_cache}"


def preemption_waits(inside: list[Ev]) -> str:
    waits = [e for e in inside if is_wait(e.kind)]
    if not waits:
        return ""
    parts = []
    for wait in waits:
        if wait.kind == ev.WAITING_FOR_KV:
            parts.append(
                f"for KV cache (needed {plural(wait.data.get('blocks_needed', 0), 'block')}"
                f" with {wait.data.get('blocks_free')} free)"
            )
        elif wait.kind == ev.WAITING_FOR_SLOT:
            parts.append(f"for a running slot (all {wait.data.get('num_running')} busy)")
        else:
            parts.append(wait.kind.removeprefix("waiting_").replace("_", " "))
    return "; while out it waited " + ", then ".join(parts)
