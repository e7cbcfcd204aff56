"""Tenants: validated CRUD on an `AsyncSession`.

The service functions flush but never commit; callers own the transaction:

    async with sessionmaker.begin() as session:
        tenant = await create_tenant(session, TenantCreate(name="acme", rpm=600))
"""

from __future__ import annotations

import logging
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, create_model, field_serializer, model_validator
from sqlalchemy import delete, select
from sqlalchemy.exc import IntegrityError
from sqlalchemy.ext.asyncio import AsyncSession

from gateway.models import ApiKey, Tenant
from gateway.tenancy.key_models import ScopedLimits, stored_limits
from gateway.tenancy.limits import LIMIT_FIELDS

log = logging.getLogger(__name__)


TENANT_NAME_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$"  # safe in Redis tags and labels


class TenantNotFound(LookupError):
    pass


class TenantNameTaken(ValueError):
    pass


def limit_fields(*, partial: bool, bounded: bool) -> dict[str, Any]:
    """The limit fields of `limits.LIMIT_FIELDS` as pydantic field definitions.

    partial: every field optional with None as "not given" (updates, patches); bounded: with the
    table's bounds (input models). Neither: as stored (output models).
    """
    fields: dict[str, Any] = {}
    for limit in LIMIT_FIELDS:
        kind = int | None if limit.nullable else int  # partial: absent (None) is "unchanged"
        if not bounded:
            fields[limit.name] = (kind, None if partial else ...)
            continue
        default = None if partial else limit.default
        fields[limit.name] = (
            kind,
            Field(default, ge=limit.ge, le=limit.le, description=limit.help),
        )
    return fields


MODEL_LIMITS_HELP = (
    "limits per served model name, nested under the tenant's: "
    '{"qwen2.5-coder-1.5b-instruct": {"rpm": 60, "tpm": 100000}}'
)


def stored_model_limits(value: dict[str, Any] | None) -> dict[str, dict[str, int]] | None:
    """As the JSON column holds them: only the limits given, only models with some."""
    given = {}
    for model, limits in (value or {}).items():
        limits = stored_limits(ScopedLimits.model_validate(limits))
        if limits:
            given[model] = limits
    return given or None


class TenantCreateFields(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    name: str = Field(pattern=TENANT_NAME_PATTERN)
    default_priority: int = Field(0, ge=-1_000_000, le=1_000_000)
    max_priority: int = Field(0, ge=-1_000_000, le=1_000_000)  # most urgent allowed
    weight: float = Field(1.0, gt=0, le=1_000_000, allow_inf_nan=False)
    enabled: bool = True
    model_limits: dict[str, ScopedLimits] | None = Field(
        None, max_length=256, description=MODEL_LIMITS_HELP
    )

    @field_serializer("model_limits")
    def _given_limits_only(self, value: dict[str, Any] | None) -> dict[str, Any] | None:
        return stored_model_limits(value)

    @model_validator(mode="after")
    def _max_priority_is_at_least_as_urgent(self) -> TenantCreateFields:
        if self.max_priority > self.default_priority:
            raise ValueError(
                "max_priority (the most urgent allowed) must be <= default_priority;"
                " lower numbers are more urgent"
            )
        return self


TenantCreate = create_model(
    "TenantCreate", __base__=TenantCreateFields, **limit_fields(partial=False, bounded=True)
)


class TenantUpdateFields(BaseModel):
    """A partial change: only the fields given are applied; `null` on a limit means unlimited."""

    model_config = ConfigDict(extra="forbid", strict=True)

    name: str | None = None
    default_priority: int | None = None
    max_priority: int | None = None
    weight: float | None = None
    enabled: bool | None = None
    model_limits: dict[str, ScopedLimits] | None = None


TenantUpdate = create_model(
    "TenantUpdate", __base__=TenantUpdateFields, **limit_fields(partial=True, bounded=False)
)


class TenantOutFields(BaseModel):
    model_config = ConfigDict(from_attributes=True)

    id: int
    name: str
    default_priority: int
    max_priority: int
    weight: float
    enabled: bool
    model_limits: dict[str, dict[str, int]] | None = None


TenantOut = create_model(
    "TenantOut", __base__=TenantOutFields, **limit_fields(partial=False, bounded=False)
)


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
    stored = merged.model_dump()
    for field in given:
        setattr(tenant, field, stored[field])
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
