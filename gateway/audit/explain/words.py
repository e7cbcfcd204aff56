"""How an explanation writes times, counts, lists and request ids."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from gateway.audit.ids import split_sequence_id


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
    parsed = split_sequence_id(engine_id)
    if parsed is None:
        return engine_id
    request_id, choice = parsed
    return request_id if choice == 0 else f"{request_id} (choice {choice})"
