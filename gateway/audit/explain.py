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
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

from gateway.audit import events as ev
from gateway.tenancy.limits import REFUSALS as LIMIT_REFUSALS

# Engine request ids made by the gateway: "<http request id>-<choice>".
GATEWAY_SEQUENCE_ID = re.compile(r"^([0-9a-f]{32})-(\d+)$")
WAIT_KINDS = (ev.WAITING_FOR_KV, ev.WAITING_FOR_SLOT)  # and any other "waiting_*" event


def is_wait(kind: str) -> bool:
    return kind.startswith("waiting_")


TRIVIAL_S = 0.001  # a wait for the next step shorter than this gets no sentence of its own
NEXT_STEP_S = 0.25  # longer, with nobody ahead, is no longer just "the next step"
REFUSALS = {reason: refusal.phrase for reason, refusal in LIMIT_REFUSALS.items()} | {
    "overloaded": "the server being overloaded or shutting down",
    "validation": "an invalid request",
}
ENDINGS = {
    "aborted": "was aborted when the client went away",
    "cancelled": "was cancelled by an operator",
    "error": "failed with a server error",
}


@dataclass
class Delay:
    """One named delay: where in the request's life it happened, how long, and why."""

    cause: str  # gateway | queue | waiting_for_kv | waiting_for_slot | preempted
    start_s: float  # seconds after the request was received
    duration_s: float
    sentence: str
    choice: int | None = None
    facts: dict[str, Any] = field(default_factory=dict)


@dataclass
class Explanation:
    sentences: list[str]
    delays: list[Delay]
    total_time_s: float | None  # received -> end (the slowest sequence)
    total_delay_s: float  # sum of every sequence's delays
    service_time_s: float | None  # sum of every sequence's service time

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


# ---- small formatting helpers ------------------------------------------------------------------
def seconds(value: float) -> str:
    """Durations people read: "<1 ms", "12 ms", "0.35 s", "4.20 s"."""
    if value < 0.0005:
        return "<1 ms"
    if value < 0.1:
        return f"{value * 1000:.0f} ms"
    return f"{value:.2f} s"


def offset(value: float) -> str:
    return f"+{value:.2f} s" if value >= 0.1 else f"+{value * 1000:.0f} ms"


def plural(count: int, noun: str) -> str:
    return f"{count} {noun}" if count == 1 else f"{count} {noun}s"


def joined(items: Iterable[Any]) -> str:
    return ", ".join(str(item) for item in items)


def sequence_name(engine_id: str) -> str:
    """The HTTP request id for a gateway sequence id (with its choice when not the first)."""
    match = GATEWAY_SEQUENCE_ID.match(engine_id or "")
    if not match:
        return engine_id
    request_id, choice = match.groups()
    return request_id if choice == "0" else f"{request_id} (choice {choice})"


# ---- events ------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Ev:
    kind: str
    time: float
    data: Mapping[str, Any]
    seq: int = 0

    @property
    def choice(self) -> int | None:
        return self.data.get("choice")


def normalise(events: Iterable[Any]) -> list[Ev]:
    """Events as stored ({kind, time, seq, data}) or flat ({kind, time, **data}), by time."""
    result = []
    for index, event in enumerate(events):
        fields = event if isinstance(event, Mapping) else vars(event)
        data = fields.get("data")
        if not isinstance(data, Mapping):
            data = {k: v for k, v in fields.items() if k not in ("kind", "time", "seq")}
        result.append(Ev(fields["kind"], float(fields["time"]), data, fields.get("seq", index)))
    return sorted(result, key=lambda e: (e.time, e.seq))


def first(events: Sequence[Ev], kind: str) -> Ev | None:
    return next((e for e in events if e.kind == kind), None)


# ---- one sequence ------------------------------------------------------------------------------
@dataclass
class Track:
    """The events of one choice and the times that bound it."""

    choice: int
    events: list[Ev]
    received: float
    end: float

    def at(self, time: float) -> float:
        return time - self.received


class Explainer:
    def __init__(self, record: Mapping[str, Any], viewer_tenant: str | None) -> None:
        self.record = record
        self.viewer = viewer_tenant
        self.priority = record.get("effective_priority")

    # -- redaction --------------------------------------------------------------------------
    def tenants_text(self, tenants: Sequence[str]) -> str:
        if self.viewer is None:
            return ("tenant " if len(tenants) == 1 else "tenants ") + joined(tenants)
        others = [t for t in tenants if t != self.viewer]
        parts = ["your tenant"] if len(others) < len(tenants) else []
        if others:
            parts.append(plural(len(others), "other tenant"))
        return " and ".join(parts)

    def request_text(self, engine_id: str, tenant: str | None) -> str:
        if self.viewer is not None and tenant != self.viewer:
            return "a request of another tenant"
        return f"request {sequence_name(engine_id)}"

    # -- the queue --------------------------------------------------------------------------
    def queue_sentence(self, facts: Mapping[str, Any], duration: float) -> str:
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
        rank = self.rank_text(facts.get("ahead_priorities") or [])
        tenants = facts.get("ahead_tenants") or []
        source = f" from {self.tenants_text(tenants)}" if tenants else ""
        return f"waited {seconds(duration)} in the queue behind {ahead}{rank}{source}{running}"

    def rank_text(self, priorities: Sequence[int]) -> str:
        if not priorities or self.priority is None:
            return ""
        label = "priority" if len(priorities) == 1 else "priorities"
        listed = f" ({label} {joined(priorities)})"
        if all(p < self.priority for p in priorities):
            return " of higher priority" + listed
        if all(p == self.priority for p in priorities):
            return " of the same priority, ahead by fair share or arrival"
        return " of higher or equal priority" + listed

    def wait_sentence(self, kind: str, facts: Mapping[str, Any], duration: float) -> str:
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
            who = self.request_text(facts.get("by") or "", facts.get("by_tenant"))
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
            if facts.get("num_running"):
                return f"waited {seconds(duration)} for the running batch to finish"
            return (
                f"waited {seconds(duration)} for a batch to form: up to "
                f"{facts.get('window_s')} s for {facts.get('batch_size')} requests"
            )
        shown = joined(f"{k} {v}" for k, v in facts.items() if k != "choice")
        reason = kind.removeprefix("waiting_").replace("_", " ")
        return f"waited {seconds(duration)} {reason}" + (f" ({shown})" if shown else "")

    def queue_delays(self, seq: Track, start: float, stop: float) -> list[Delay]:
        """[start, stop) cut at each wait event; each piece named by the event that began it."""
        queued = first(seq.events, ev.QUEUED)
        delays = []
        gateway_end = min(queued.time, stop) if queued else stop
        if gateway_end > start or queued is None:
            delays.append(self.gateway_delay(seq, start, gateway_end))
        if queued is None:
            return delays
        cuts = [(queued.time, "queue", queued.data)]
        cuts += [(e.time, e.kind, e.data) for e in seq.events if is_wait(e.kind)]
        cuts = [cut for cut in cuts if cut[0] < stop] or cuts[:1]
        for (begin, kind, facts), (end, _, _) in zip(cuts, cuts[1:] + [(stop, "", {})]):
            delays.append(self.segment(seq, kind, facts, begin, max(end, begin)))
        return delays

    def gateway_delay(self, seq: Track, start: float, end: float) -> Delay:
        duration = max(end - start, 0.0)
        sentence = (
            f"spent {seconds(duration)} in the gateway (reading and tokenizing the prompt, "
            "checking rate limits) before joining the engine queue"
        )
        return Delay("gateway", seq.at(start), duration, sentence, seq.choice)

    def segment(self, seq: Track, kind: str, facts, begin: float, end: float) -> Delay:
        duration = end - begin
        if kind == "queue":
            sentence = self.queue_sentence(facts, duration)
        else:
            sentence = self.wait_sentence(kind, facts, duration)
        shown = {k: v for k, v in facts.items() if k != "choice"}
        return Delay(kind, seq.at(begin), duration, sentence, seq.choice, self.redact(shown))

    # -- preemptions ------------------------------------------------------------------------
    def preemption_delays(self, seq: Track) -> list[Delay]:
        delays = []
        for index, event in enumerate(seq.events):
            if event.kind != ev.PREEMPTED:
                continue
            later = seq.events[index + 1 :]
            stop = next((i for i, e in enumerate(later) if e.kind == ev.RESUMED), None)
            end = later[stop].time if stop is not None else seq.end
            inside = later[:stop] if stop is not None else later
            delays.append(self.preemption(seq, event, inside, end, stop is not None))
        return delays

    def preemption(self, seq: Track, event: Ev, inside: list[Ev], end: float, resumed: bool):
        facts = event.data
        mode, num_blocks = facts.get("mode"), facts.get("num_blocks", 0)
        by, by_tenant = facts.get("by", ""), facts.get("by_tenant")
        if by and by == f"{self.record.get('id')}-{seq.choice}":
            cause = "to make room for itself: it needed another KV block and was the least urgent"
        else:
            who = self.request_text(by, by_tenant)
            details = [f"priority {facts.get('by_priority')}"]
            if self.viewer is None or by_tenant == self.viewer:
                details.append(f"tenant {by_tenant}")
            cause = f"by {who} ({joined(details)})"
        duration = end - event.time
        sentence = f"preempted at {offset(seq.at(event.time))} {cause}; "
        sentence += self.preemption_cost(mode, num_blocks, inside)
        sentence += self.preemption_waits(inside)
        if resumed:
            sentence += f", resumed after {seconds(duration)}"
        else:
            sentence += f", and was still preempted {seconds(duration)} later when it ended"
        shown = self.redact({k: v for k, v in facts.items() if k != "choice"})
        return Delay(ev.PREEMPTED, seq.at(event.time), duration, sentence, seq.choice, shown)

    def preemption_cost(self, mode: str | None, num_blocks: int, inside: list[Ev]) -> str:
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

    def preemption_waits(self, inside: list[Ev]) -> str:
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

    def redact(self, facts: dict[str, Any]) -> dict[str, Any]:
        return redact_facts(facts, self.viewer)

    # -- whole sequences --------------------------------------------------------------------
    def sequence_delays(self, seq: Track) -> tuple[list[Delay], float]:
        scheduled = first(seq.events, ev.SCHEDULED)
        queue_end = scheduled.time if scheduled else seq.end
        delays = self.queue_delays(seq, seq.received, queue_end)
        delays += self.preemption_delays(seq)
        return delays, seq.end - seq.received


def redact_facts(facts: Mapping[str, Any], viewer: str | None) -> dict[str, Any]:
    """Event facts as `viewer` may see them: other tenants' names and request ids removed."""
    result = dict(facts)
    if viewer is None:
        return result
    if "ahead_tenants" in result:
        tenants = list(result["ahead_tenants"] or [])
        result["ahead_tenants"] = [t for t in tenants if t == viewer]
        result["num_other_tenants_ahead"] = len([t for t in tenants if t != viewer])
    if "by_tenant" in result and result["by_tenant"] != viewer:
        result["by_tenant"] = None
        result["by"] = None
    return result


def redact_events(events: Iterable[Mapping[str, Any]], viewer: str) -> list[dict[str, Any]]:
    """Stored events ({seq, kind, time, data}) with their facts redacted for `viewer`."""
    return [{**event, "data": redact_facts(event.get("data") or {}, viewer)} for event in events]


# ---- the request -------------------------------------------------------------------------------
def split_sequences(events: list[Ev], end_of_request: float | None) -> tuple[float, list[Track]]:
    received_event = first(events, ev.RECEIVED)
    received = received_event.time if received_event else (events[0].time if events else 0.0)
    choices = sorted({e.choice for e in events if e.choice is not None})
    sequences = []
    for choice in choices:
        own = [e for e in events if e.choice == choice]
        sequences.append(Track(choice, own, received, sequence_end(own, end_of_request)))
    return received, sequences


def sequence_end(events: list[Ev], end_of_request: float | None) -> float:
    for kind in (ev.FINISHED, ev.ABORTED):
        event = first(events, kind)
        if event is not None:
            return event.time
    if end_of_request is not None:
        return max(end_of_request, events[-1].time)
    return events[-1].time


def explain(
    record: Mapping[str, Any], events: Iterable[Any], *, viewer_tenant: str | None = None
) -> Explanation:
    """Sentences accounting for where the request's time went, and its named delays."""
    evs = normalise(events)
    completed = first(evs, ev.COMPLETED)
    received, sequences = split_sequences(evs, completed.time if completed else None)
    explainer = Explainer(record, viewer_tenant)
    if record.get("status") == "rejected" or not sequences:
        return refused_explanation(record, evs, received)
    delays: list[Delay] = []
    totals: list[float] = []
    for seq in sequences:
        seq_delays, total = explainer.sequence_delays(seq)
        delays += seq_delays
        totals.append(total)
    delays.sort(key=lambda d: (d.choice or 0, d.start_s))
    total_delay = sum(d.duration_s for d in delays)
    service = sum(totals) - total_delay
    sentences = [overview(record, evs, received, max(totals))] + grammar_sentences(evs)
    sentences += delay_sentences(delays, multi=len(sequences) > 1)
    sentences.append(accounting(sequences, delays, totals, record))
    return Explanation(sentences, delays, max(totals), total_delay, service)


def overview(record: Mapping[str, Any], evs: list[Ev], received: float, total: float) -> str:
    status = record.get("status") or "finished"
    prompt, completion = record.get("prompt_tokens"), record.get("completion_tokens")
    tokens = f"{plural(completion or 0, 'completion token')} for a {prompt}-token prompt"
    first_token = first(evs, ev.FIRST_TOKEN)
    ttft = f"; first token at {offset(first_token.time - received)}" if first_token else ""
    priority = record.get("effective_priority")
    at_priority = f" at priority {priority}" if priority is not None else ""
    if first(evs, ev.ADMITTED) and first(evs, ev.ADMITTED).data.get("rate_limits_unchecked"):
        at_priority += " (rate limits unchecked: Redis was unreachable and limits fail open)"
    if status in ENDINGS:
        ended = first(evs, ev.CANCELLED) if status == "cancelled" else None
        when = offset((ended.time if ended else received + total) - received)
        text = f"The request{at_priority} {ENDINGS[status]} at {when}, after {tokens}{ttft}."
        if status == "error" and record.get("error"):
            text += f" Error: {record['error']}."
        return text
    reason = record.get("finish_reason")
    why = f" ({reason})" if reason else ""
    return f"The request{at_priority} finished{why} in {seconds(total)}: {tokens}{ttft}."


def grammar_sentences(evs: list[Ev]) -> list[str]:
    """A constrained request: its grammar and what compiling it cost, before admission."""
    prepared = first(evs, ev.GRAMMAR_PREPARED)
    if prepared is None:
        return []
    data = prepared.data
    cost = "from the grammar cache" if data.get("cache_hit") else (
        f"compiled in {data.get('compile_ms', 0):.1f} ms before admission")  # fmt: skip
    return [f"Its output was constrained by a {data.get('grammar', '')} grammar, {cost}."]


def delay_sentences(delays: list[Delay], multi: bool) -> list[str]:
    """One sentence per delay, except sub-millisecond waits for the next step (the total
    in the closing sentence still counts them)."""
    sentences = []
    for delay in delays:
        if is_trivial(delay):
            continue
        text = delay.sentence[0].upper() + delay.sentence[1:]
        if multi:
            text = f"Choice {delay.choice}: {delay.sentence}"
        sentences.append(text + ".")
    return sentences


def is_trivial(delay: Delay) -> bool:
    no_one_ahead = delay.cause == "queue" and not delay.facts.get("num_ahead")
    return no_one_ahead and delay.duration_s < TRIVIAL_S


def accounting(sequences, delays: list[Delay], totals: list[float], record) -> str:
    parts = []
    for seq, total in zip(sequences, totals):
        own = [d for d in delays if d.choice == seq.choice]
        by_cause: dict[str, float] = {}
        for delay in own:
            name = "queue" if delay.cause == "queue" or is_wait(delay.cause) else delay.cause
            by_cause[name] = by_cause.get(name, 0.0) + delay.duration_s
        waited = sum(by_cause.values())
        causes = joined(f"{name} {seconds(value)}" for name, value in by_cause.items())
        prefix = f"choice {seq.choice}: " if len(sequences) > 1 else ""
        parts.append(
            f"{prefix}{seconds(total)} = {seconds(waited)} of delay ({causes}) + "
            f"{seconds(max(total - waited, 0.0))} running on the engine"
        )
    return "In total, " + "; ".join(parts) + "."


def refused_explanation(record: Mapping[str, Any], evs: list[Ev], received: float) -> Explanation:
    reason = record.get("refusal_reason")
    refused = first(evs, ev.REFUSED)
    when = f" after {seconds(refused.time - received)}" if refused else ""
    cause = REFUSALS.get(reason or "", reason or "an unknown reason")
    sentence = f"The request was refused{when} because of {cause}; it never reached the engine."
    if record.get("status") != "rejected":
        sentence = "The request has no engine events: it never reached the engine."
    sentences = [sentence]
    if record.get("error"):
        sentences.append(f"The client was told: {record['error']}")
    total = refused.time - received if refused else None
    return Explanation(sentences, [], total, 0.0, None)
