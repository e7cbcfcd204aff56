"""The whole request: its overview, grammar, one sentence per delay, the closing accounting,
and the short story of a request refused before it reached the engine."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

from gateway.audit import events as ev
from gateway.audit.explain.delays import Delay, Explanation
from gateway.audit.explain.preemption import preemption_delays
from gateway.audit.explain.queue import queue_delays
from gateway.audit.explain.tracks import Ev, Track, first, is_wait, normalise, split_sequences
from gateway.audit.explain.viewpoint import Viewpoint
from gateway.audit.explain.words import joined, offset, plural, seconds
from gateway.tenancy.limits import REFUSALS as LIMIT_REFUSALS

TRIVIAL_S = 0.001  # a wait for the next step shorter than this gets no sentence of its own
REFUSALS = {reason: refusal.phrase for reason, refusal in LIMIT_REFUSALS.items()} | {
    "overloaded": "the server being overloaded or shutting down",
    "validation": "an invalid request",
    "scope": "the key's scopes (a model or endpoint it may not use)",
}
ENDINGS = {
    "aborted": "was aborted when the client went away",
    "cancelled": "was cancelled by an operator",
    "error": "failed with a server error",
}


def explain(
    record: Mapping[str, Any], events: Iterable[Any], *, viewer_tenant: str | None = None
) -> Explanation:
    """Sentences accounting for where the request's time went, and its named delays."""
    evs = normalise(events)
    completed = first(evs, ev.COMPLETED)
    received, sequences = split_sequences(evs, completed.time if completed else None)
    view = Viewpoint(record, viewer_tenant)
    if record.get("status") == "rejected" or not sequences:
        return refused_explanation(record, evs, received)
    delays: list[Delay] = []
    totals: list[float] = []
    for seq in sequences:
        seq_delays, total = sequence_delays(view, seq)
        delays += seq_delays
        totals.append(total)
    delays.sort(key=lambda d: (d.choice or 0, d.start_s))
    total_delay = sum(d.duration_s for d in delays)
    service = sum(totals) - total_delay
    sentences = [overview(record, evs, received, max(totals))] + grammar_sentences(evs)
    sentences += delay_sentences(delays, multi=len(sequences) > 1)
    sentences.append(accounting(sequences, delays, totals, record))
    return Explanation(sentences, delays, max(totals), total_delay, service)


def sequence_delays(view: Viewpoint, seq: Track) -> tuple[list[Delay], float]:
    scheduled = first(seq.events, ev.SCHEDULED)
    queue_end = scheduled.time if scheduled else seq.end
    delays = queue_delays(view, seq, seq.received, queue_end)
    delays += preemption_delays(view, seq)
    return delays, seq.end - seq.received


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


def scope_owner(refused_by: str) -> str:
    kind, _, rest = refused_by.partition(" ")
    if kind == "key":
        return f"key {rest}'s"
    if rest.startswith("model "):
        return f"the tenant's per-model ({rest.removeprefix('model ')})"
    return "the tenant's"


def refused_explanation(record: Mapping[str, Any], evs: list[Ev], received: float) -> Explanation:
    reason = record.get("refusal_reason")
    refused = first(evs, ev.REFUSED)
    when = f" after {seconds(refused.time - received)}" if refused else ""
    cause = REFUSALS.get(reason or "", reason or "an unknown reason")
    if record.get("refused_by"):  # which limit: "key 7", "tenant", "tenant model <name>"
        cause = cause.replace("the tenant's", scope_owner(record["refused_by"]))
    sentence = f"The request was refused{when} because of {cause}; it never reached the engine."
    if record.get("status") != "rejected":
        sentence = "The request has no engine events: it never reached the engine."
    sentences = [sentence]
    if record.get("error"):
        sentences.append(f"The client was told: {record['error']}")
    total = refused.time - received if refused else None
    return Explanation(sentences, [], total, 0.0, None)
