"""Tenants: validated CRUD on an `AsyncSession`.

The service functions flush but never commit; callers own the transaction:

    async with sessionmaker.begin() as session:
        tenant = await create_tenant(session, TenantCreate(name="acme", rpm=600))
"""

from __future__ import annotations

import logging
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, model_validator
from sqlalchemy import delete, select
from sqlalchemy.exc import IntegrityError
from sqlalchemy.ext.asyncio import AsyncSession

from gateway.models import ApiKey, Tenant

log = logging.getLogger(__name__)


INT32_MAX = 2**31 - 1


INT64_MAX = 2**63 - 1


TENANT_NAME_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$"  # safe in Redis tags and labels


class TenantNotFound(LookupError):
    pass


class TenantNameTaken(ValueError):
    pass


class TenantCreate(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    name: str = Field(pattern=TENANT_NAME_PATTERN)
    default_priority: int = Field(0, ge=-1_000_000, le=1_000_000)
    max_priority: int = Field(0, ge=-1_000_000, le=1_000_000)  # most urgent allowed
    weight: float = Field(1.0, gt=0, le=1_000_000, allow_inf_nan=False)
    rpm: int | None = Field(None, ge=1, le=INT32_MAX)
    tpm: int | None = Field(None, ge=1, le=INT64_MAX)
    max_concurrency: int | None = Field(None, ge=1, le=INT32_MAX)
    daily_token_quota: int | None = Field(None, ge=1, le=INT64_MAX)
    monthly_token_quota: int | None = Field(None, ge=1, le=INT64_MAX)
    enabled: bool = True

    @model_validator(mode="after")
    def _max_priority_is_at_least_as_urgent(self) -> TenantCreate:
        if self.max_priority > self.default_priority:
            raise ValueError(
                "max_priority (the most urgent allowed) must be <= default_priority;"
                " lower numbers are more urgent"
            )
        return self


class TenantUpdate(BaseModel):
    """A partial change: only the fields given are applied; `null` on a limit means unlimited."""

    model_config = ConfigDict(extra="forbid", strict=True)

    name: str | None = None
    default_priority: int | None = None
    max_priority: int | None = None
    weight: float | None = None
    rpm: int | None = None
    tpm: int | None = None
    max_concurrency: int | None = None
    daily_token_quota: int | None = None
    monthly_token_quota: int | None = None
    enabled: bool | None = None


class TenantOut(BaseModel):
    model_config = ConfigDict(from_attributes=True)

    id: int
    name: str
    default_priority: int
    max_priority: int
    weight: float
    rpm: int | None
    tpm: int | None
    max_concurrency: int | None
    daily_token_quota: int | None
    monthly_token_quota: int | None
    enabled: bool


TENANT_FIELDS = tuple(TenantCreate.model_fields)


def tenant_fields(tenant: Any) -> dict[str, Any]:
    """The shared field names of a tenant (ORM row or pydantic model) as a plain dict."""
    return {field: getattr(tenant, field) for field in TENANT_FIELDS}


async def create_tenant(session: AsyncSession, data: TenantCreate) -> TenantOut:
    await _check_name_free(session, data.name)
    tenant = Tenant(**data.model_dump())
    session.add(tenant)
    await _flush_or_name_taken(session, data.name)
    return TenantOut.model_validate(tenant)


async def list_tenants(session: AsyncSession) -> list[TenantOut]:
    tenants = await session.scalars(select(Tenant).order_by(Tenant.id))
    return [TenantOut.model_validate(tenant) for tenant in tenants]


async def get_tenant(session: AsyncSession, tenant_id: int) -> TenantOut:
    return TenantOut.model_validate(await load_tenant(session, tenant_id))


async def get_tenant_by_name(session: AsyncSession, name: str) -> TenantOut:
    tenant = await session.scalar(select(Tenant).where(Tenant.name == name))
    if tenant is None:
        raise TenantNotFound(f"no tenant named {name!r}")
    return TenantOut.model_validate(tenant)


async def update_tenant(session: AsyncSession, tenant_id: int, changes: TenantUpdate) -> TenantOut:
    """Apply `changes`; the merged tenant is validated as a whole (pydantic ValidationError)."""
    tenant = await load_tenant(session, tenant_id)
    given = changes.model_dump(exclude_unset=True)
    current = tenant_fields(tenant)
    merged = TenantCreate.model_validate({**current, **given})
    if "name" in given and merged.name != tenant.name:
        await _check_name_free(session, merged.name)
    for field in given:
        setattr(tenant, field, getattr(merged, field))
    await _flush_or_name_taken(session, merged.name)
    return TenantOut.model_validate(tenant)


async def delete_tenant(session: AsyncSession, tenant_id: int) -> None:
    """Delete the tenant and its keys; its audit records stay."""
    await load_tenant(session, tenant_id)
    await session.execute(delete(ApiKey).where(ApiKey.tenant_id == tenant_id))
    await session.execute(delete(Tenant).where(Tenant.id == tenant_id))


async def load_tenant(session: AsyncSession, tenant_id: int) -> Tenant:
    tenant = await session.get(Tenant, tenant_id)
    if tenant is None:
        raise TenantNotFound(f"no tenant with id {tenant_id}")
    return tenant


async def _check_name_free(session: AsyncSession, name: str) -> None:
    if await session.scalar(select(Tenant.id).where(Tenant.name == name)) is not None:
        raise TenantNameTaken(f"a tenant named {name!r} already exists")


async def _flush_or_name_taken(session: AsyncSession, name: str) -> None:
    try:
        await session.flush()
    except IntegrityError as error:  # a concurrent create won the race for the name
        raise TenantNameTaken(f"a tenant named {name!r} already exists") from error
