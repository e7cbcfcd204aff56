"""One request's life as a timeline: per choice, a lane of segments that tile the time from
arrival to its end (the explanation's delays, and between them prefill and decode on the engine),
with marks (admitted, first token, swap in, recompute, finished) and the decode rate.

A pure function of the record, its events and its explanation (no I/O), like `explain`. The
delays come from the explanation itself, so a segment's hover sentence is the explanation's
sentence for it, and the lanes add up exactly as the explanation's accounting does. With
`viewer_tenant` set, the facts are the redacted ones: another tenant's request is shown by its
priority only.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import asdict, dataclass, field
from typing import Any

from gateway.audit import events as ev
from gateway.audit.explain import Delay, Explanation, explain, seconds
from gateway.audit.explain.tracks import Ev, Track, first, normalise, split_sequences
from gateway.audit.explain.words import plural
from gateway.audit.ids import sequence_id, split_sequence_id

SERVICE_KINDS = ("prefill", "decode")


@dataclass
class Cause:
    """The request that preempted this one, as the viewer may see it."""

    priority: int | None
    tenant: str | None  # None: another tenant's (hidden from a tenant)
    request_id: str | None  # the HTTP request id; None when hidden
    is_self: bool = False  # preempted to make room for its own growth


@dataclass
class Segment:
    kind: str  # gateway | queue | waiting_* | preempted | prefill | decode
    choice: int
    start_s: float  # seconds after the request was received
    end_s: float
    label: str
    sentence: str
    facts: dict[str, Any] = field(default_factory=dict)
    cause: Cause | None = None
    phases: list[tuple[str, float, float]] = field(default_factory=list)  # inside a preemption

    @property
    def duration_s(self) -> float:
        return self.end_s - self.start_s


@dataclass
class Mark:
    kind: str  # admitted | first_token | swapped_in | recompute_started | finished | aborted
    at_s: float
    label: str
    choice: int | None = None


@dataclass
class Lane:
    choice: int
    end_s: float
    segments: list[Segment]
    marks: list[Mark]
    num_output_tokens: int | None
    decode_s: float
    tokens_per_s: float | None  # after the first token, over the decode segments
    # (seconds after arrival, tokens/s since the point before): the decode rate along the way
    rate_points: list[tuple[float, float]] = field(default_factory=list)


@dataclass
class Timeline:
    request_id: str
    status: str
    priority: int | None
    prompt_tokens: int | None
    completion_tokens: int | None
    total_s: float
    lanes: list[Lane]
    marks: list[Mark]  # the request's own (admitted, first token)
    sentences: list[str]
    refused: bool = False

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def build_timeline(
    record: Mapping[str, Any], events: Iterable[Any], *, viewer_tenant: str | None = None
) -> Timeline:
    evs = normalise(events)
    explanation = explain(record, evs_as_dicts(evs), viewer_tenant=viewer_tenant)
    completed = first(evs, ev.COMPLETED)
    received, tracks = split_sequences(evs, completed.time if completed else None)
    first_token = first(evs, ev.FIRST_TOKEN)
    first_token_at = first_token.time if first_token else None
    lanes = [
        lane_of(record, track, explanation, first_token_at, evs)
        for track in tracks
        if record.get("status") != "rejected"
    ]
    total = max([lane.end_s for lane in lanes], default=explanation.total_time_s or 0.0)
    return Timeline(
        request_id=str(record.get("id")),
        status=str(record.get("status") or "finished"),
        priority=record.get("effective_priority"),
        prompt_tokens=record.get("prompt_tokens"),
        completion_tokens=record.get("completion_tokens"),
        total_s=max(total, 0.0),
        lanes=lanes,
        marks=request_marks(evs, received),
        sentences=explanation.sentences,
        refused=not lanes,
    )


def evs_as_dicts(evs: list[Ev]) -> list[dict[str, Any]]:
    return [{"kind": e.kind, "time": e.time, "seq": e.seq, "data": dict(e.data)} for e in evs]


def request_marks(evs: list[Ev], received: float) -> list[Mark]:
    marks = []
    admitted = first(evs, ev.ADMITTED)
    if admitted is not None:
        marks.append(Mark("admitted", admitted.time - received, "admitted"))
    first_token = first(evs, ev.FIRST_TOKEN)
    if first_token is not None:
        marks.append(Mark("first_token", first_token.time - received, "first token"))
    return marks


# ---- one lane ----------------------------------------------------------------------------------
def lane_of(
    record: Mapping[str, Any],
    track: Track,
    explanation: Explanation,
    first_token_at: float | None,
    all_events: list[Ev],
) -> Lane:
    delays = [d for d in explanation.delays if d.choice == track.choice]
    first_token_s = None if first_token_at is None else track.at(first_token_at)
    segments = [delay_segment(record, track, d, all_events) for d in delays]
    segments += service_segments(track, segments, first_token_s)
    segments.sort(key=lambda s: (s.start_s, s.kind in SERVICE_KINDS))
    finished = first(track.events, ev.FINISHED)
    num_output = finished.data.get("num_output_tokens") if finished else None
    decode_s = sum(s.duration_s for s in segments if s.kind == "decode")
    rate = (num_output - 1) / decode_s if num_output and num_output > 1 and decode_s > 0 else None
    for segment in segments:
        describe_service(segment, track, num_output, rate, decode_s)
    return Lane(
        track.choice,
        track.at(track.end),
        segments,
        lane_marks(track),
        num_output,
        decode_s,
        rate,
        decode_rates(track, first_token_s),
    )


def decode_rates(track: Track, first_token_s: float | None) -> list[tuple[float, float]]:
    """Tokens/s between consecutive progress points (the first token is the first point)."""
    if first_token_s is None:
        return []
    points = [(first_token_s, 1)] + [
        (track.at(e.time), e.data.get("num_output_tokens", 0))
        for e in track.events
        if e.kind == ev.DECODE_PROGRESS
    ]
    return [
        (at, (count - before_count) / (at - before_at))
        for (before_at, before_count), (at, count) in zip(points, points[1:])
        if at > before_at and count > before_count
    ]


def delay_segment(
    record: Mapping[str, Any], track: Track, delay: Delay, all_events: list[Ev]
) -> Segment:
    end = delay.start_s + delay.duration_s
    segment = Segment(
        delay.cause, track.choice, delay.start_s, end, label_of(delay), delay.sentence,
        dict(delay.facts),
    )  # fmt: skip
    if delay.cause == ev.PREEMPTED:
        segment.cause = cause_of(record, track, delay.facts)
        segment.phases = preemption_phases(track, delay.start_s, end, delay.facts.get("mode"))
    elif delay.cause == "gateway":
        segment.phases = gateway_phases(all_events, track.received, delay.start_s, end)
    return segment


def label_of(delay: Delay) -> str:
    if delay.cause == ev.PREEMPTED:
        mode = delay.facts.get("mode")
        return "preempted (swapped to CPU)" if mode == "swap" else "preempted (to recompute)"
    if delay.cause in ("gateway", "queue"):
        return {"gateway": "gateway", "queue": "queued"}[delay.cause]
    return delay.cause.replace("_", " ")


def cause_of(record: Mapping[str, Any], track: Track, facts: Mapping[str, Any]) -> Cause:
    by = facts.get("by")
    is_self = bool(by) and by == sequence_id(record.get("id"), track.choice)
    parsed = split_sequence_id(by)
    request_id = parsed[0] if parsed else by
    return Cause(facts.get("by_priority"), facts.get("by_tenant"), request_id, is_self)


WAITING_FOR = {
    "kv": "waiting for KV cache",
    "slot": "waiting for a running slot",
    "behind": "waiting behind the head of the line",
    "budget": "waiting for room in a step",
}


def preemption_phases(
    track: Track, start_s: float, end_s: float, mode: str | None
) -> list[tuple[str, float, float]]:
    """Out of the engine, cut where it began to wait for something to come back."""
    inside = [e for e in track.events if start_s < track.at(e.time) < end_s]
    first_phase = "swapped out to CPU" if mode == "swap" else "blocks freed, to be recomputed"
    cuts = [(start_s, first_phase)] + [
        (track.at(e.time), waiting_name(e.kind)) for e in inside if e.kind.startswith("waiting_")
    ]
    ends = [cut[0] for cut in cuts[1:]] + [end_s]
    return [(name, begin, end) for (begin, name), end in zip(cuts, ends)]


def waiting_name(kind: str) -> str:
    reason = kind.removeprefix("waiting_for_").removeprefix("waiting_")
    return WAITING_FOR.get(reason, "waiting " + reason.replace("_", " "))


def gateway_phases(
    events: list[Ev], received: float, start_s: float, end_s: float
) -> list[tuple[str, float, float]]:
    """Before admission (reading, tokenizing, the tenant's limits), then on to the engine."""
    admitted = first(events, ev.ADMITTED)
    if admitted is None or not start_s < admitted.time - received < end_s:
        return []
    at = admitted.time - received
    return [("reading, tokenizing, checking limits", start_s, at), ("to the engine", at, end_s)]


def service_segments(
    track: Track, delays: list[Segment], first_token_s: float | None
) -> list[Segment]:
    """The gaps between the delays, from the first step to the lane's end: the engine ran it."""
    busy = sorted((s.start_s, s.end_s) for s in delays)
    gaps, cursor = [], 0.0
    for start, end in busy:
        if start > cursor:
            gaps.append((cursor, start))
        cursor = max(cursor, end)
    lane_end = track.at(track.end)
    if lane_end > cursor:
        gaps.append((cursor, lane_end))
    chunks = [track.at(e.time) for e in track.events if e.kind == ev.PREFILL_CHUNK]
    segments = []
    for start, end in gaps:
        for segment in split_at_first_token(track.choice, start, end, first_token_s):
            segments += split_prefill(segment, chunks) if segment.kind == "prefill" else [segment]
    return segments


def split_prefill(segment: Segment, chunk_starts: list[float]) -> list[Segment]:
    """A prefill segment cut where each later chunk of the prompt was scheduled."""
    cuts = [t for t in chunk_starts if segment.start_s < t < segment.end_s]
    edges = [segment.start_s, *cuts, segment.end_s]
    return [
        Segment("prefill", segment.choice, start, end, "prefill", "")
        for start, end in zip(edges, edges[1:])
    ]


def split_at_first_token(
    choice: int, start: float, end: float, first_token_s: float | None
) -> list[Segment]:
    if first_token_s is None or first_token_s >= end:
        return [Segment("prefill", choice, start, end, "prefill", "")]
    if first_token_s <= start:
        return [Segment("decode", choice, start, end, "decode", "")]
    return [
        Segment("prefill", choice, start, first_token_s, "prefill", ""),
        Segment("decode", choice, first_token_s, end, "decode", ""),
    ]


def describe_service(
    segment: Segment, track: Track, num_output: int | None, rate: float | None, decode_s: float
) -> None:
    if segment.kind == "prefill":
        segment.facts = prefill_facts(track, segment)
        segment.sentence = prefill_sentence(segment, segment.facts)
    elif segment.kind == "decode":
        segment.facts = {"num_output_tokens": num_output, "tokens_per_s": rate}
        segment.sentence = decode_sentence(segment, num_output, rate, decode_s)


def prefill_facts(track: Track, segment: Segment) -> dict[str, Any]:
    """The facts of the prompt chunk that started this segment (the first: SCHEDULED)."""
    scheduled = first(track.events, ev.SCHEDULED)
    if scheduled is None:
        return {}
    chunks = [scheduled] + [e for e in track.events if e.kind == ev.PREFILL_CHUNK]
    starts = [track.at(e.time) for e in chunks]
    index = max((i for i, t in enumerate(starts) if t <= segment.start_s + 1e-9), default=0)
    facts = {"chunk": index + 1, "num_chunks": len(chunks)}
    if index == 0:
        facts["first_chunk_tokens"] = scheduled.data.get("num_tokens")
        facts["num_cached_tokens"] = scheduled.data.get("num_cached_tokens", 0)
    else:
        facts["chunk_tokens"] = chunks[index].data.get("num_tokens")
    return facts


def prefill_sentence(segment: Segment, facts: Mapping[str, Any]) -> str:
    text = f"ran the prompt (prefill) for {seconds(segment.duration_s)} on the engine"
    if facts.get("num_chunks", 1) > 1:
        text = (
            f"ran chunk {facts['chunk']} of {facts['num_chunks']} of the prompt (prefill) for "
            f"{seconds(segment.duration_s)} on the engine"
        )
    chunk, cached = facts.get("first_chunk_tokens"), facts.get("num_cached_tokens")
    if chunk:
        text += f"; its first step computed {plural(chunk, 'prompt token')}"
    if cached:
        text += f", {cached} more came from the prefix cache"
    if facts.get("chunk_tokens"):
        text += f"; this step computed {plural(facts['chunk_tokens'], 'prompt token')}"
    return text


def decode_sentence(
    segment: Segment, num_output: int | None, rate: float | None, decode_s: float
) -> str:
    text = f"generated tokens (decode) for {seconds(segment.duration_s)}"
    if rate is not None and num_output:
        text += (
            f"; after the first token, {plural(num_output - 1, 'token')} in "
            f"{seconds(decode_s)} of decode: {rate:.1f} tokens/s"
        )
    return text


def lane_marks(track: Track) -> list[Mark]:
    names = {
        ev.SWAPPED_IN: "swapped in",
        ev.RECOMPUTE_STARTED: "recompute",
        ev.FINISHED: "finished",
        ev.ABORTED: "aborted",
    }
    return [
        Mark(e.kind, track.at(e.time), names[e.kind], track.choice)
        for e in track.events
        if e.kind in names
    ]
