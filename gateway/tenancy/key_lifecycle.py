"""A key's life after creation: its changes (name, expiry, scopes, limits) and its rotation,
which issues a successor and lets the old key work on until a grace period ends.

Like the other service functions these flush but never commit; callers own the transaction and,
once it has committed, announce the change to every replica (`Authenticator.announce_change`).
"""

from __future__ import annotations

from datetime import timedelta

from sqlalchemy.ext.asyncio import AsyncSession

from gateway.models import ApiKey, utcnow
from gateway.tenancy.key_models import KeyCreate, KeyPatch, stored_limits
from gateway.tenancy.keys import ApiKeyNotFound, KeyHasher, create_key


class KeyNotRotatable(ValueError):
    """A revoked key, or one already rotated, cannot be rotated (again)."""


class KeyRevoked(ValueError):
    """A revoked key stays on record as it was revoked: it cannot be changed."""


async def load_key(session: AsyncSession, key_id: int) -> ApiKey:
    key = await session.get(ApiKey, key_id)
    if key is None:
        raise ApiKeyNotFound(f"no API key with id {key_id}")
    return key


async def update_key(session: AsyncSession, key_id: int, patch: KeyPatch) -> ApiKey:
    """Apply the fields given in `patch` (null clears); `duration` counts from now."""
    key = await load_key(session, key_id)
    if key.revoked_at is not None:
        raise KeyRevoked(f"API key {key_id} is revoked: it cannot be changed")
    given = patch.model_dump(exclude_unset=True)
    if "expires_at" in given or "duration" in given:
        key.expires_at = patch.expiry(utcnow())
    for field in ("name", "models", "endpoints"):
        if field in given:
            setattr(key, field, given[field])
    if "limits" in given:
        key.limits = stored_limits(patch.limits)
    await session.flush()
    return key


async def rotate_key(
    session: AsyncSession, key_id: int, hasher: KeyHasher, grace_seconds: int
) -> tuple[ApiKey, str, ApiKey]:
    """A successor with the same tenant, name, expiry, scopes and limits: (new key, its
    plaintext, the old key), the old one working for `grace_seconds` more."""
    old = await load_key(session, key_id)
    if old.revoked_at is not None:
        raise KeyNotRotatable(f"API key {key_id} is revoked")
    if old.grace_ends_at is not None:
        raise KeyNotRotatable(f"API key {key_id} was already rotated (to {old.replaced_by_id})")
    spec = KeyCreate(name=old.name, expires_at=old.expires_at, models=old.models,
                     endpoints=old.endpoints)  # fmt: skip
    new, plaintext = await create_key(session, old.tenant_id, hasher, spec)
    new.limits = old.limits
    new.lineage_id = old.lineage_id or old.id  # a rotation does not reset the key's limits
    old.grace_ends_at = utcnow() + timedelta(seconds=grace_seconds)
    old.replaced_by_id = new.id
    await session.flush()
    return new, plaintext, old
