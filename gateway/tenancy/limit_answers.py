"""The rate limiter's answer to one admission: allowed or refused, why and by which limit (the
tenant's, its key's, or the tenant's for one model), and the `x-ratelimit-*` headers of the
tightest limit that applied.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from gateway.tenancy.limit_scopes import RequestLimits
from gateway.tenancy.limits import REFUSALS


@dataclass(frozen=True)
class Admission:
    """The answer to one `admit` call, with what the HTTP layer needs to tell the client."""

    allowed: bool
    reason: str | None = None
    refused_by: str | None = None  # the refusing set: "tenant", "key 7", "tenant model m"
    retry_after: float = 0.0
    degraded: bool = False
    reserved_tokens: int = 0
    limit_requests: int | None = None
    remaining_requests: int | None = None
    reset_requests: float | None = None
    limit_tokens: int | None = None
    remaining_tokens: int | None = None
    reset_tokens: float | None = None

    @property
    def code(self) -> str | None:
        """OpenAI error code for the refusal body."""
        refusal = REFUSALS.get(self.reason or "")
        return refusal.code if refusal else None

    @property
    def error_type(self) -> str:
        """OpenAI error type for the refusal body."""
        refusal = REFUSALS.get(self.reason or "")
        return refusal.error_type if refusal else "requests"

    @property
    def http_status(self) -> int:
        if self.allowed:
            return 200
        refusal = REFUSALS.get(self.reason or "")
        return refusal.http_status if refusal else 429

    @property
    def message(self) -> str:
        if self.allowed:
            return ""
        refusal = REFUSALS.get(self.reason or "")
        retry = f" Please retry after {format_reset(self.retry_after)}."
        text = refusal.message if refusal else "Request refused."
        if self.refused_by is not None:
            text = text.rstrip(".") + f" (the limit of the {self.refused_by})."
        return text + retry

    def headers(self) -> dict[str, str]:
        headers: dict[str, str] = {}
        if self.limit_requests is not None:
            headers["x-ratelimit-limit-requests"] = str(self.limit_requests)
            headers["x-ratelimit-remaining-requests"] = str(self.remaining_requests)
            headers["x-ratelimit-reset-requests"] = format_reset(self.reset_requests or 0.0)
        if self.limit_tokens is not None:
            headers["x-ratelimit-limit-tokens"] = str(self.limit_tokens)
            headers["x-ratelimit-remaining-tokens"] = str(self.remaining_tokens)
            headers["x-ratelimit-reset-tokens"] = format_reset(self.reset_tokens or 0.0)
        if not self.allowed:
            headers["Retry-After"] = str(max(1, math.ceil(self.retry_after)))
        return headers


def format_reset(seconds: float) -> str:
    """A duration the way OpenAI's headers write it (Go style): "120ms", "1s", "1.5s", "6m0s"."""
    total_ms = max(0, math.ceil(seconds * 1000 - 1e-6))
    if total_ms == 0:
        return "0s"
    if total_ms < 1000:
        return f"{total_ms}ms"
    hours, rest_ms = divmod(total_ms, 3_600_000)
    minutes, rest_ms = divmod(rest_ms, 60_000)
    secs = f"{rest_ms / 1000:.3f}".rstrip("0").rstrip(".") + "s"
    if hours:
        return f"{hours}h{minutes}m{secs}"
    if minutes:
        return f"{minutes}m{secs}"
    return secs


def admission_from_reply(limits: RequestLimits, cost: int, reply: list) -> Admission:
    """The ADMIT script's reply (see `limit_scripts.ADMIT_LUA`) as an Admission whose headers
    show, for requests and for tokens, the set with the least left."""
    allowed, reason, wait_ms, refusing = reply[:4]
    states = [reply[4 + 4 * i : 8 + 4 * i] for i in range(len(limits.scopes))]
    requests = tightest(limits, states, "rpm", 0)
    tokens = tightest(limits, states, "tpm", 2)
    return Admission(
        allowed=bool(allowed),
        reason=decoded(reason) or None,
        refused_by=limits.scopes[int(refusing) - 1].label if int(refusing) > 0 else None,
        retry_after=max(int(wait_ms), 1) / 1000 if not allowed else 0.0,
        reserved_tokens=cost if allowed else 0,
        limit_requests=requests[0],
        remaining_requests=requests[1],
        reset_requests=requests[2],
        limit_tokens=tokens[0],
        remaining_tokens=tokens[1],
        reset_tokens=tokens[2],
    )


def tightest(limits: RequestLimits, states: list, field: str, at: int) -> tuple[Any, Any, Any]:
    """(limit, left, reset s) of the set with the least left of `field`; Nones when none has
    that limit. Ties go to the smaller limit."""
    candidates = [
        (int(state[at]), getattr(scope.limits, field), int(state[at + 1]) / 1000)
        for scope, state in zip(limits.scopes, states, strict=True)
        if getattr(scope.limits, field) is not None
    ]
    if not candidates:
        return None, None, None
    left, limit, reset = min(candidates, key=lambda c: (c[0], c[1]))
    return limit, left, reset


def decoded(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)
