"""The limit sets one request is held to: its tenant's, its key's (if the key has limits of its
own) and its tenant's for the model it asks for (`model_limits`), checked and reserved together
by one script. Each set has its own counters in Redis, under the tenant's hash tag (so all of a
request's keys are in one Redis Cluster slot) and a label that names it in refusals.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

TENANT_SCOPE = "tenant"


@dataclass(frozen=True)
class ScopedLimits:
    """One limit set: `label` names it ("tenant", "key 7", "tenant model qwen"), `suffix`
    places its counters after the tenant's base key ("" for the tenant's own)."""

    label: str
    suffix: str
    limits: Any  # ratelimit.TenantLimits


@dataclass(frozen=True)
class RequestLimits:
    """Every limit set of one request, the tenant's first."""

    tenant: str
    scopes: tuple[ScopedLimits, ...]

    @property
    def has_concurrency_limit(self) -> bool:
        return any(scope.limits.max_concurrency is not None for scope in self.scopes)


def as_request_limits(limits: Any) -> RequestLimits:
    """A tenant's limits alone (TenantLimits) or already a RequestLimits."""
    if isinstance(limits, RequestLimits):
        return limits
    return RequestLimits(limits.tenant, (ScopedLimits(TENANT_SCOPE, "", limits),))


def escaped(name: str) -> str:
    """A model name as a part of a Redis key: no braces (hash tags), no colons."""
    return name.replace("%", "%25").replace("{", "%7B").replace("}", "%7D").replace(":", "%3A")


def key_scope(key_id: int, limits: Any, lineage_id: int | None = None) -> ScopedLimits:
    """A key's own limits; counted for its whole lineage (the keys a rotation chain made)."""
    return ScopedLimits(f"key {key_id}", f":key:{lineage_id or key_id}", limits)


def model_scope(model: str, limits: Any) -> ScopedLimits:
    return ScopedLimits(f"{TENANT_SCOPE} model {model}", f":model:{escaped(model)}", limits)
