"""Who goes first: a request's effective (aged) priority, its tenant's weighted service (fair
share between tenants), then arrival. The scheduler asks; this class keeps the tenants' service."""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable

from scheduler.config import SchedulerConfig
from scheduler.request import Request, RequestStatus


class LineOrder:
    def __init__(self, config: SchedulerConfig) -> None:
        self.config = config
        self.tenant_service: dict[str, float] = defaultdict(float)  # weighted tokens served

    @property
    def by_priority(self) -> bool:
        return self.config.policy == "priority"

    def effective_priority(self, request: Request, now: float) -> int:
        """With aging, a waiting request gains a level per `priority_aging_s` since it arrived;
        a running one keeps the level it was admitted at."""
        aging = self.config.priority_aging_s
        if not aging or not self.by_priority:
            return request.priority
        if request.status is RequestStatus.RUNNING and request.admitted_priority is not None:
            return request.admitted_priority
        return request.priority - int((now - request.arrival_time) / aging)

    def urgency(self, request: Request, now: float) -> tuple:
        """Smaller is more urgent; the largest is the first preemption victim."""
        if self.by_priority:
            return (self.effective_priority(request, now), request.arrival_time, request.seq)
        return (request.arrival_time, request.seq)

    def line_key(self, request: Request, now: float) -> tuple:
        if not self.by_priority:
            return (request.arrival_time, request.seq)
        service = self.tenant_service[request.tenant]
        return (self.effective_priority(request, now), service, request.arrival_time, request.seq)

    def more_urgent(self, request: Request, than: Request, now: float) -> bool:
        if not self.by_priority:
            return False
        return self.effective_priority(request, now) < self.effective_priority(than, now)

    def start_fair_share(self, tenant: str, active_tenants: Iterable[str]) -> None:
        """A tenant new to the line starts at the current minimum, so it cannot bank credit."""
        if tenant in self.tenant_service:
            return
        service = self.tenant_service
        floor = min((service[t] for t in set(active_tenants) if t in service), default=0.0)
        service[tenant] = floor

    def charge(self, request: Request, num_tokens: int) -> None:
        """Count tokens handed to the request (negative: handed back) against its tenant."""
        self.tenant_service[request.tenant] += num_tokens / request.weight
