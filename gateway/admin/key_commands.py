"""What `conveyor keys create|update|rotate` do: a key's name, expiry, scopes and limits from
flags, and its rotation with a grace period. Like the other commands: a database session per
command, one line on stderr and exit 1 on an expected failure.

A change is announced to running servers through Redis when `--redis-url` (or
`CONVEYOR_REDIS_URL`) is given; without it, servers notice within their cache lifetime (2 s).
"""

from __future__ import annotations

import argparse
import json
import os
from typing import Any

from gateway.admin.commands import (
    database,
    find_key,
    key_hasher,
    key_row,
    print_record,
)
from gateway.tenancy.limits import SCRIPT_LIMIT_FIELDS

SPEC_FIELDS = ("name", "expires_at", "duration", "models", "endpoints")


def given_key_spec(args: argparse.Namespace) -> dict[str, Any]:
    """The key fields given as flags (`none` clears a limit, an expiry or a scope)."""
    spec = {field: getattr(args, field) for field in SPEC_FIELDS if field in args}
    limits = {limit.name: getattr(args, limit.name) for limit in SCRIPT_LIMIT_FIELDS
              if limit.name in args}  # fmt: skip
    if limits:
        spec["limits"] = limits
    return spec


async def announce(args: argparse.Namespace) -> str:
    """Tell running servers (through Redis) that keys changed; the sentence to print."""
    from gateway.redis_client import make_redis
    from gateway.tenancy.key_changes import KeyChanges

    url = getattr(args, "redis_url", None) or os.environ.get("CONVEYOR_REDIS_URL")
    if not url:
        return "Servers notice within 2 s (pass --redis-url to tell them at once)."
    redis = make_redis(url)
    try:
        told = await KeyChanges(redis).bump()
    finally:
        await redis.aclose()
    return "Every server knows at once." if told else "Redis unreachable: servers notice in 2 s."


async def keys_create(args: argparse.Namespace) -> None:
    from gateway.tenancy.key_models import KeyCreate
    from gateway.tenancy.keys import create_key
    from gateway.tenancy.tenants import get_tenant_by_name

    spec = KeyCreate.model_validate(given_key_spec(args))  # before touching the database
    hasher = key_hasher(args)
    async with database(args.database_url) as sessionmaker, sessionmaker.begin() as session:
        tenant = await get_tenant_by_name(session, args.tenant)
        key, plaintext = await create_key(session, tenant.id, hasher, spec)
    # printed only once the transaction has committed: a shown key always exists
    if args.json:
        print(json.dumps({**key_row(key, tenant.name), "key": plaintext}, indent=2))
        return
    print(f"Created API key {key.id} ({key.prefix}) for tenant {tenant.name!r}:")
    print(f"  {plaintext}")
    print("Store it now: it is not stored anywhere and will not be shown again.")


async def keys_update(args: argparse.Namespace) -> None:
    from gateway.models import Tenant
    from gateway.tenancy.key_lifecycle import update_key
    from gateway.tenancy.key_models import KeyPatch

    given = given_key_spec(args)
    KeyPatch.model_validate(given)  # before touching the database
    async with database(args.database_url) as sessionmaker, sessionmaker.begin() as session:
        key = await find_key(session, args)
        if "limits" in given:  # a limit flag changes that limit; `none` removes it
            given["limits"] = {**(key.limits or {}), **given["limits"]}
        key = await update_key(session, key.id, KeyPatch.model_validate(given))
        tenant = await session.get(Tenant, key.tenant_id)
    told = await announce(args)
    changed = ", ".join(sorted(given)) or "nothing"
    print_record(args, key_row(key, tenant.name), f"Updated API key {key.id}: {changed}. {told}")


async def keys_rotate(args: argparse.Namespace) -> None:
    from gateway.models import Tenant
    from gateway.tenancy.key_lifecycle import rotate_key

    hasher = key_hasher(args)
    async with database(args.database_url) as sessionmaker, sessionmaker.begin() as session:
        old = await find_key(session, args)
        new, plaintext, old = await rotate_key(session, old.id, hasher, args.grace_seconds)
        tenant = await session.get(Tenant, new.tenant_id)
    told = await announce(args)
    if args.json:
        record = {**key_row(new, tenant.name), "key": plaintext}
        print(json.dumps({**record, "replaces": key_row(old, tenant.name)}, indent=2))
        return
    print(f"Rotated API key {old.id} to {new.id} ({new.prefix}) for tenant {tenant.name!r}:")
    print(f"  {plaintext}")
    print(f"The old key works until {old.grace_ends_at.isoformat(timespec='seconds')}. {told}")
    print("Store the new key now: it will not be shown again.")


async def keys_revoke(args: argparse.Namespace) -> None:
    from gateway.models import Tenant
    from gateway.tenancy.keys import revoke_key

    async with database(args.database_url) as sessionmaker, sessionmaker.begin() as session:
        key = await find_key(session, args)
        was_revoked = key.revoked_at is not None
        key = await revoke_key(session, key.id)
        tenant = await session.get(Tenant, key.tenant_id)
    row = key_row(key, tenant.name)
    if was_revoked:
        message = f"API key {key.id} ({key.prefix}) was already revoked at {row['revoked_at']}."
    else:
        message = (
            f"Revoked API key {key.id} ({key.prefix}) of tenant {tenant.name!r};"
            f" {await announce(args)}"
        )
    print_record(args, row, message)
