"""What an explanation is made of: named delays and the sentences that account for them."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any


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
