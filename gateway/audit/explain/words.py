"""How an explanation writes times, counts, lists and request ids."""

from __future__ import annotations

import re
from collections.abc import Iterable
from typing import Any

# Engine request ids made by the gateway: "<http request id>-<choice>".
GATEWAY_SEQUENCE_ID = re.compile(r"^([0-9a-f]{32})-(\d+)$")


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
