"""Tenants, their API keys and their usage over the admin API.

    POST   /admin/tenants                    TenantCreate -> 201 TenantOut
    GET    /admin/tenants                    -> TenantList
    GET    /admin/tenants/{tenant_id}        -> TenantOut
    PATCH  /admin/tenants/{tenant_id}        TenantPatch -> TenantOut
    DELETE /admin/tenants/{tenant_id}        -> 204 (its keys go too; its audit records stay)
    GET    /admin/tenants/{tenant_id}/usage  -> TenantUsage

(The keys: `gateway.admin.keys`.) Changes take effect on this replica at once (its
authentication cache is cleared) and on the others at their next request (the change is
announced through Redis; within the cache's lifetime, 2 s, while Redis is unreachable).
"""

from __future__ import annotations

import re
from typing import Any

from aiohttp import web
from pydantic import BaseModel, ConfigDict, Field, ValidationError, create_model

from gateway.appkeys import AUTHENTICATOR, RATE_LIMITER, SESSIONMAKER
from gateway.errors import APIError, deepest_problem, from_validation_error
from gateway.jsonbody import read_model
from gateway.tenancy.key_models import ScopedLimits
from gateway.tenancy.limits import INT32_MAX, LIMIT_FIELDS
from gateway.tenancy.tenants import (
    TENANT_NAME_PATTERN,
    TenantCreate,
    TenantNameTaken,
    TenantNotFound,
    TenantOut,
    TenantUpdate,
    create_tenant,
    delete_tenant,
    get_tenant,
    limit_fields,
    list_tenants,
    update_tenant,
)


# ---- bodies ----------------------------------------------------------------------------------
class TenantPatchFields(BaseModel):
    """Only the fields given change; `null` on a limit removes it (unlimited). The tenant as a
    whole must stay valid (e.g. max_priority <= default_priority)."""

    model_config = ConfigDict(extra="forbid", strict=True)

    # not nullable: a tenant always has these (left out: unchanged)
    name: str = Field(None, pattern=TENANT_NAME_PATTERN)
    default_priority: int = Field(None, ge=-1_000_000, le=1_000_000)
    max_priority: int = Field(None, ge=-1_000_000, le=1_000_000)
    weight: float = Field(None, gt=0, le=1_000_000, allow_inf_nan=False)
    enabled: bool = None
    model_limits: dict[str, ScopedLimits] | None = Field(
        None, max_length=256, description="null removes every per-model limit"
    )


TenantPatch = create_model(
    "TenantPatch", __base__=TenantPatchFields, **limit_fields(partial=True, bounded=True)
)


class TenantList(BaseModel):
    items: list[TenantOut]


class TenantUsageFields(BaseModel):
    """Tokens against quotas (UTC day and month) and the live rate-limit state, from Redis,
    next to the tenant's configured limits."""

    tenant_id: int
    tenant: str
    available: bool = Field(description="false: Redis unreachable, the numbers are unknown")
    tokens_today: int | None = None
    tokens_this_month: int | None = None
    daily_tokens_remaining: int | None = None
    monthly_tokens_remaining: int | None = None
    requests_remaining: int | None = Field(None, description="admissible now (last 60 s)")
    requests_reset_s: float | None = Field(None, description="until one more is admissible")
    tokens_this_minute: int | None = Field(None, description="reserved in the last 60 s")
    tokens_remaining: int | None = None
    tokens_reset_s: float | None = None
    concurrency: int | None = Field(None, description="requests running now")


TenantUsage = create_model(
    "TenantUsage", __base__=TenantUsageFields, **limit_fields(partial=False, bounded=False)
)


# ---- helpers ---------------------------------------------------------------------------------
async def read_json(request: web.Request, model: type[BaseModel]) -> Any:
    return await read_model(request, model, body_error)


def body_error(error: ValidationError) -> APIError:
    """Fields valid one by one but in conflict with each other (or with the tenant they change)
    are a 409; anything else a 400 naming the field."""
    problem = deepest_problem(error)
    if not problem["loc"] and problem["type"] == "value_error":
        message = problem["msg"].removeprefix("Value error, ")
        return APIError(409, f"Conflicting fields: {message}", code="conflicting_fields")
    return from_validation_error(error)


ID_PATTERN = re.compile(r"[0-9]{1,10}")
ID_SCHEMA = {"type": "integer", "minimum": 0, "maximum": INT32_MAX}  # the id columns' range


def int_param(request: web.Request, name: str) -> int:
    """A path id as the id columns hold it; anything else is a 404 before it reaches SQL."""
    value = request.match_info[name]
    if not ID_PATTERN.fullmatch(value) or int(value) > INT32_MAX:
        raise APIError(404, f"No such {name.removesuffix('_id')}: {value!r}.", code="not_found")
    return int(value)


def not_found(error: LookupError) -> APIError:
    return APIError(404, str(error), code="not_found")


def name_taken(error: TenantNameTaken) -> APIError:
    return APIError(409, str(error), param="name", code="tenant_name_taken")


def json_model(model: BaseModel, status: int = 200) -> web.Response:
    return web.json_response(text=model.model_dump_json(), status=status)


async def forget_cached_keys(request: web.Request) -> None:
    """Forget cached keys here and tell every other replica (after the change committed)."""
    authenticator = request.config_dict.get(AUTHENTICATOR)
    if authenticator is not None:
        await authenticator.announce_change()


# ---- tenants ---------------------------------------------------------------------------------
async def create_tenant_handler(request: web.Request) -> web.Response:
    data = await read_json(request, TenantCreate)
    try:
        async with request.config_dict[SESSIONMAKER].begin() as session:
            tenant = await create_tenant(session, data)
    except TenantNameTaken as error:
        raise name_taken(error) from None
    return json_model(tenant, status=201)


async def list_tenants_handler(request: web.Request) -> web.Response:
    async with request.config_dict[SESSIONMAKER]() as session:
        tenants = await list_tenants(session)
    return json_model(TenantList(items=tenants))


async def get_tenant_handler(request: web.Request) -> web.Response:
    return json_model(await load_tenant(request))


async def load_tenant(request: web.Request) -> TenantOut:
    tenant_id = int_param(request, "tenant_id")
    try:
        async with request.config_dict[SESSIONMAKER]() as session:
            return await get_tenant(session, tenant_id)
    except TenantNotFound as error:
        raise not_found(error) from None


async def update_tenant_handler(request: web.Request) -> web.Response:
    tenant_id = int_param(request, "tenant_id")
    patch = await read_json(request, TenantPatch)
    changes = TenantUpdate.model_validate(patch.model_dump(exclude_unset=True))
    try:
        async with request.config_dict[SESSIONMAKER].begin() as session:
            tenant = await update_tenant(session, tenant_id, changes)
    except TenantNotFound as error:
        raise not_found(error) from None
    except TenantNameTaken as error:
        raise name_taken(error) from None
    except ValidationError as error:  # the tenant as changed would not be valid
        raise body_error(error) from None
    await forget_cached_keys(request)
    return json_model(tenant)


async def delete_tenant_handler(request: web.Request) -> web.Response:
    tenant_id = int_param(request, "tenant_id")
    try:
        async with request.config_dict[SESSIONMAKER].begin() as session:
            await delete_tenant(session, tenant_id)
    except TenantNotFound as error:
        raise not_found(error) from None
    await forget_cached_keys(request)
    return web.Response(status=204)


# ---- usage -----------------------------------------------------------------------------------
async def usage_handler(request: web.Request) -> web.Response:
    from gateway.tenancy.admission import tenant_limits

    tenant = await load_tenant(request)
    state = await request.config_dict[RATE_LIMITER].usage(tenant_limits(tenant))
    configured = {"tenant_id": tenant.id, "tenant": tenant.name}
    configured |= {limit.name: getattr(tenant, limit.name) for limit in LIMIT_FIELDS}
    live = {k: v for k, v in state.items() if k in TenantUsage.model_fields}
    usage = TenantUsage(**{**live, **configured})
    return json_model(usage)
