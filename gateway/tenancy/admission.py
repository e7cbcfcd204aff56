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
from gateway.tenancy.limits import LIMIT_FIELDS
from gateway.tenancy.ratelimit import Admission, TenantLimits


def tenant_limits(tenant: Any) -> TenantLimits:
    """The limits of a tenant (ORM row or pydantic model) as the rate limiter takes them."""
    return TenantLimits(
        tenant=tenant.name, **{limit.name: getattr(tenant, limit.name) for limit in LIMIT_FIELDS}
    )


def refusal_error(admission: Admission) -> APIError:
    return APIError(
        admission.http_status,
        admission.message,
        type=admission.error_type,
        code=admission.code,
        headers=admission.headers(),
    )


def start_lease_renewal(
    app: web.Application, limits: TenantLimits, request_id: str
) -> asyncio.Task | None:
    """Concurrency leases expire (so a dead replica's leases vanish): renew while running."""
    if limits.max_concurrency is None:
        return None
    return asyncio.create_task(renew_lease(app[RATE_LIMITER], limits, request_id))


async def renew_lease(limiter, limits: TenantLimits, request_id: str) -> None:
    while True:
        await asyncio.sleep(limiter.lease_ttl_s / 3)
        await limiter.renew(limits, request_id)
