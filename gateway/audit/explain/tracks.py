"""The events of a request as the explanation reads them: normalised, ordered by time, and
split into one track per engine sequence (a "choice"), with the times that bound each."""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from gateway.audit import events as ev

WAIT_KINDS = (ev.WAITING_FOR_KV, ev.WAITING_FOR_SLOT)  # and any other "waiting_*" event


def is_wait(kind: str) -> bool:
    return kind.startswith("waiting_")


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


@dataclass
class Track:
    """The events of one choice and the times that bound it."""

    choice: int
    events: list[Ev]
    received: float
    end: float

    def at(self, time: float) -> float:
        return time - self.received


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
