"""What each `conveyor tenants|keys|db …` command does: a database session per command, the
service functions of `gateway.tenancy`, Alembic, and the printed table or JSON record; any
expected failure becomes one line on stderr and exit status 1.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import sys
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

from pydantic import ValidationError
from pydantic_settings import BaseSettings, SettingsConfigDict

from gateway.settings import DEV_KEY_HASH_SECRET, ServeSettings
from gateway.tenancy.limits import LIMIT_NAMES

TENANT_COLUMNS = ("id", "name", "enabled", "default_priority", "max_priority", "weight")
TENANT_COLUMNS += LIMIT_NAMES


KEY_COLUMNS = ("id", "tenant", "prefix", "name", "status", "expires_at", "grace_ends_at",
               "last_used_at", "models", "endpoints", "limits")  # fmt: skip


class CommandError(Exception):
    """A refusal worth one line to the operator (no traceback)."""


class AdminSettings(BaseSettings):
    """The server settings these commands need, read the way `conveyor serve` reads them."""

    model_config = SettingsConfigDict(env_prefix="CONVEYOR_", extra="ignore")

    database_url: str = ServeSettings.model_fields["database_url"].default
    key_hash_secret: str | None = None


# ==== running a command =======================================================================
Command = Callable[[argparse.Namespace], Awaitable[None]]


def runner(command: Command) -> Callable[[argparse.Namespace], int]:
    """Run `command` on its own event loop; known failures become one line on stderr, exit 1."""

    def run(args: argparse.Namespace) -> int:
        settings = AdminSettings()
        args.database_url = args.database_url or settings.database_url
        if "key_hash_secret" in args:
            args.key_hash_secret = args.key_hash_secret or settings.key_hash_secret
        try:
            asyncio.run(command(args))
        except Exception as error:
            message = describe_error(error)
            if message is None:
                raise
            print(f"conveyor: error: {message}", file=sys.stderr)
            return 1
        return 0

    return run


def describe_error(error: Exception) -> str | None:
    """One line for the errors an operator can cause; None for bugs (they keep a traceback)."""
    from alembic.util import CommandError as AlembicError
    from sqlalchemy.exc import SQLAlchemyError

    from gateway.tenancy.keys import ApiKeyNotFound
    from gateway.tenancy.tenants import TenantNameTaken, TenantNotFound

    if isinstance(error, ValidationError):
        return "invalid values: " + validation_summary(error)
    if isinstance(error, TenantNotFound | TenantNameTaken | ApiKeyNotFound | CommandError):
        return str(error)
    if isinstance(error, AlembicError):
        return f"migration failed: {error}"
    if isinstance(error, SQLAlchemyError):
        return database_error_summary(error)
    if isinstance(error, ValueError | OSError):  # unsupported URLs, unreadable files
        return str(error)
    return None


def validation_summary(error: ValidationError) -> str:
    parts = []
    for item in error.errors():
        message = item["msg"].removeprefix("Value error, ")
        field = ".".join(str(part) for part in item["loc"])
        parts.append(f"{field}: {message}" if field else message)
    return "; ".join(parts)


def database_error_summary(error: Exception) -> str:
    original = getattr(error, "orig", None) or error
    first_line = (str(original).strip().splitlines() or [type(original).__name__])[0]
    hint = ""
    if "no such table" in first_line or "does not exist" in first_line:
        hint = " (has `conveyor db upgrade` been run on this database?)"
    return f"database error: {first_line}{hint}"


def shown_url(url: str) -> str:
    from gateway.db import parse_database_url

    return parse_database_url(url).render_as_string(hide_password=True)


def require_existing_sqlite(url: str) -> None:
    """A mistyped SQLite path must not quietly create an empty database."""
    from gateway.db import parse_database_url

    parsed = parse_database_url(url)
    database = parsed.database
    if parsed.drivername != "sqlite" or not database or database == ":memory:":
        return
    if database.startswith("file:"):
        return
    if not Path(database).exists():
        raise CommandError(f"no database at {database}; run `conveyor db upgrade` to create it")


@contextlib.asynccontextmanager
async def database(url: str) -> AsyncIterator[Any]:
    """A sessionmaker on the database at `url`, disposed afterwards."""
    from gateway.db import make_async_engine, make_sessionmaker

    require_existing_sqlite(url)
    engine = make_async_engine(url)
    try:
        yield make_sessionmaker(engine)
    finally:
        await engine.dispose()


def key_hasher(args: argparse.Namespace):
    from gateway.tenancy.keys import KeyHasher

    if not args.key_hash_secret:
        print(
            "conveyor: warning: no --key-hash-secret or CONVEYOR_KEY_HASH_SECRET: using the"
            " development secret (keys work only on a server that has no secret set either)",
            file=sys.stderr,
        )
    return KeyHasher(args.key_hash_secret or DEV_KEY_HASH_SECRET)


# ==== tenants =================================================================================
def given_tenant_fields(args: argparse.Namespace) -> dict[str, Any]:
    from gateway.tenancy.tenants import TENANT_FIELDS

    return {field: getattr(args, field) for field in TENANT_FIELDS if field in args}


async def tenants_create(args: argparse.Namespace) -> None:
    from gateway.tenancy.tenants import TenantCreate, create_tenant

    data = TenantCreate(**given_tenant_fields(args))  # validated before touching the database
    async with database(args.database_url) as sessionmaker, sessionmaker.begin() as session:
        tenant = await create_tenant(session, data)
    print_record(args, tenant.model_dump(), f"Created tenant {tenant.name!r} (id {tenant.id}).")


async def tenants_list(args: argparse.Namespace) -> None:
    from gateway.tenancy.tenants import list_tenants

    async with database(args.database_url) as sessionmaker, sessionmaker() as session:
        tenants = await list_tenants(session)
    rows = [tenant.model_dump() for tenant in tenants]
    if args.json:
        print(json.dumps(rows, indent=2))
    elif rows:
        print(format_table(rows, TENANT_COLUMNS))
    else:
        print("No tenants yet: `conveyor tenants create --name NAME` adds one.")


async def tenants_update(args: argparse.Namespace) -> None:
    from gateway.tenancy.tenants import TenantUpdate, get_tenant_by_name, update_tenant

    given = given_tenant_fields(args)
    if not given:
        raise CommandError("nothing to change: give at least one field flag (see --help)")
    changes = TenantUpdate(**given)
    async with database(args.database_url) as sessionmaker, sessionmaker.begin() as session:
        tenant = await get_tenant_by_name(session, args.tenant)
        updated = await update_tenant(session, tenant.id, changes)
    changed = ", ".join(sorted(given))
    print_record(args, updated.model_dump(), f"Updated tenant {args.tenant!r}: {changed}.")


# ==== keys ====================================================================================
async def keys_list(args: argparse.Namespace) -> None:
    from gateway.tenancy.keys import list_keys
    from gateway.tenancy.tenants import get_tenant_by_name

    async with database(args.database_url) as sessionmaker, sessionmaker() as session:
        tenant = await get_tenant_by_name(session, args.tenant)
        keys = await list_keys(session, tenant.id)
    rows = [key_row(key, tenant.name) for key in keys]
    if args.json:
        print(json.dumps(rows, indent=2))
    elif rows:
        print(format_table(rows, KEY_COLUMNS))
    else:
        print(f"Tenant {tenant.name!r} has no keys: `conveyor keys create --tenant NAME`.")


async def find_key(session, args: argparse.Namespace):
    """The one key named by id, by full plaintext (hashed with the secret) or by prefix."""
    from sqlalchemy import select

    from gateway.models import ApiKey
    from gateway.tenancy.keys import ApiKeyNotFound, looks_like_key
    from gateway.tenancy.tenants import get_tenant_by_name

    text = args.key.strip()
    query = select(ApiKey).order_by(ApiKey.id)
    if text.isdigit():
        query = query.where(ApiKey.id == int(text))
    elif looks_like_key(text):
        query = query.where(ApiKey.key_hash == key_hasher(args).hash(text))
    else:
        query = query.where(ApiKey.prefix == text)
    if args.tenant:
        tenant = await get_tenant_by_name(session, args.tenant)
        query = query.where(ApiKey.tenant_id == tenant.id)
    keys = list(await session.scalars(query))
    if not keys:
        raise ApiKeyNotFound(f"no API key matches {shorten_key(text)!r}")
    if len(keys) > 1:
        ids = ", ".join(str(key.id) for key in keys)
        raise CommandError(f"{text!r} matches keys {ids}: name one by its id")
    return keys[0]


def shorten_key(text: str) -> str:
    """Never echo a whole key back (it may be a live one with the wrong secret)."""
    from gateway.tenancy.keys import KEY_PREFIX_LEN, looks_like_key

    return text[:KEY_PREFIX_LEN] + "..." if looks_like_key(text) else text


def key_row(key: Any, tenant_name: str) -> dict[str, Any]:
    from gateway.tenancy.key_models import ApiKeyOut

    row = ApiKeyOut.model_validate(key).model_dump(mode="json")
    row["tenant"] = tenant_name
    row["status"] = row["state"]  # active, expiring, expired, revoked or rotated
    return row


# ==== db ======================================================================================
async def db_upgrade(args: argparse.Namespace) -> None:
    from gateway.db import current_revision, upgrade

    await asyncio.to_thread(upgrade, args.database_url, args.revision)
    revision = await asyncio.to_thread(current_revision, args.database_url)
    print(f"Database {shown_url(args.database_url)} is at revision {revision or 'base'}.")


async def db_downgrade(args: argparse.Namespace) -> None:
    from gateway.db import current_revision, downgrade

    require_existing_sqlite(args.database_url)
    await asyncio.to_thread(downgrade, args.database_url, args.revision)
    revision = await asyncio.to_thread(current_revision, args.database_url)
    print(f"Database {shown_url(args.database_url)} is at revision {revision or 'base'}.")


async def db_current(args: argparse.Namespace) -> None:
    from gateway.db import current_revision

    require_existing_sqlite(args.database_url)
    revision = await asyncio.to_thread(current_revision, args.database_url)
    print(revision or "base")


# ==== output ==================================================================================
def print_record(args: argparse.Namespace, record: dict[str, Any], message: str) -> None:
    if args.json:
        print(json.dumps(record, indent=2))
        return
    print(message)
    width = max(len(name) for name in record)
    for name, value in record.items():
        print(f"  {name:<{width}}  {cell(value)}")


def cell(value: Any) -> str:
    """None is an unlimited limit or a time that has not happened: shown as `-`."""
    if value is None:
        return "-"
    if isinstance(value, bool):
        return "yes" if value else "no"
    return str(value)


def format_table(rows: list[dict[str, Any]], columns: tuple[str, ...]) -> str:
    cells = [[cell(row[column]) for column in columns] for row in rows]
    widths = [
        max(len(column), *(len(line[i]) for line in cells)) for i, column in enumerate(columns)
    ]
    lines = [columns, *cells]
    return "\n".join(
        "  ".join(text.ljust(width) for text, width in zip(line, widths)).rstrip() for line in lines
    )
