"""Who reads the explanation: an operator sees everything; a tenant reading its own request
(`viewer` set) sees other tenants' names and request ids replaced by counts and "another
tenant", so one tenant never learns about another."""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from gateway.audit.explain.words import joined, plural, sequence_name


class Viewpoint:
    """The record being explained and the tenant reading it (None: an operator)."""

    def __init__(self, record: Mapping[str, Any], viewer_tenant: str | None) -> None:
        self.record = record
        self.viewer = viewer_tenant
        self.priority = record.get("effective_priority")

    def may_see(self, tenant: str | None) -> bool:
        return self.viewer is None or tenant == self.viewer

    def tenants_text(self, tenants: Sequence[str]) -> str:
        if self.viewer is None:
            return ("tenant " if len(tenants) == 1 else "tenants ") + joined(tenants)
        others = [t for t in tenants if t != self.viewer]
        parts = ["your tenant"] if len(others) < len(tenants) else []
        if others:
            parts.append(plural(len(others), "other tenant"))
        return " and ".join(parts)

    def request_text(self, engine_id: str, tenant: str | None) -> str:
        if not self.may_see(tenant):
            return "a request of another tenant"
        return f"request {sequence_name(engine_id)}"

    def rank_text(self, priorities: Sequence[int]) -> str:
        """How the requests ahead ranked against this one."""
        if not priorities or self.priority is None:
            return ""
        label = "priority" if len(priorities) == 1 else "priorities"
        listed = f" ({label} {joined(priorities)})"
        if all(p < self.priority for p in priorities):
            return " of higher priority" + listed
        if all(p == self.priority for p in priorities):
            return " of the same priority, ahead by fair share or arrival"
        return " of higher or equal priority" + listed

    def redact(self, facts: Mapping[str, Any]) -> dict[str, Any]:
        return redact_facts(facts, self.viewer)


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
