"""A tenant's limits as the rate limiter takes them, refusals as OpenAI-shaped errors, and the
renewal of concurrency leases.
"""

from __future__ import annotations

import asyncio
from typing import Any

from aiohttp import web

from gateway.appkeys import (
    RATE_LIMITER,
)
from gateway.errors import (
    APIError,
)
from gateway.tenancy.limit_scopes import RequestLimits, as_request_limits, key_scope, model_scope
from gateway.tenancy.limits import LIMIT_FIELDS
from gateway.tenancy.ratelimit import Admission, TenantLimits


def tenant_limits(tenant: Any) -> TenantLimits:
    """The limits of a tenant (ORM row or pydantic model) as the rate limiter takes them."""
    return TenantLimits(
        tenant=tenant.name, **{limit.name: getattr(tenant, limit.name) for limit in LIMIT_FIELDS}
    )


def request_limits(principal: Any, model: str | None = None) -> RequestLimits:
    """The tenant's limits, its key's own (if any) and the tenant's for `model` (if any)."""
    tenant = principal.tenant
    limits = as_request_limits(tenant_limits(tenant))
    scopes = list(limits.scopes)
    key_limits = getattr(principal.key, "limits", None)
    if key_limits:
        own = TenantLimits(tenant=tenant.name, **key_limits)
        scopes.append(key_scope(principal.key_id, own, getattr(principal.key, "lineage_id", None)))
    per_model = (getattr(tenant, "model_limits", None) or {}).get(model or "")
    if per_model:
        scopes.append(model_scope(model, TenantLimits(tenant=tenant.name, **per_model)))
    return RequestLimits(tenant.name, tuple(scopes))


def refusal_error(admission: Admission) -> APIError:
    return APIError(
        admission.http_status,
        admission.message,
        type=admission.error_type,
        code=admission.code,
        headers=admission.headers(),
    )


def start_lease_renewal(
    app: web.Application, limits: RequestLimits, request_id: str
) -> asyncio.Task | None:
    """Concurrency leases expire (so a dead replica's leases vanish): renew while running."""
    if not as_request_limits(limits).has_concurrency_limit:
        return None
    return asyncio.create_task(renew_lease(app[RATE_LIMITER], limits, request_id))


async def renew_lease(limiter, limits: RequestLimits, request_id: str) -> None:
    while True:
        await asyncio.sleep(limiter.lease_ttl_s / 3)
        await limiter.renew(limits, request_id)
