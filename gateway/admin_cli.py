"""Operator commands on the database `conveyor serve` uses: `conveyor tenants ...`,
`conveyor keys ...` and `conveyor db ...`.

    conveyor db upgrade                                  # create or migrate the schema
    conveyor tenants create --name acme --rpm 600 --tpm 100000 --max-priority -1
    conveyor tenants list [--json]
    conveyor tenants update acme --rpm none --disable    # `none` removes a limit
    conveyor keys create --tenant acme                   # prints the key once
    conveyor keys list --tenant acme
    conveyor keys revoke 7                               # by id, prefix (cvy_ab12) or full key

Every command takes `--database-url` (default: `CONVEYOR_DATABASE_URL`, else the server's
default `sqlite:///conveyor.db`). Keys are hashed with `--key-hash-secret` (default:
`CONVEYOR_KEY_HASH_SECRET`, else the server's development secret), which must be the server's.
Flags carry the shared field names (`--max-priority` sets `max_priority`, ...). Errors print
one line and exit 1; bad flags exit 2 (argparse).
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

LIMIT_FIELDS = ("rpm", "tpm", "max_concurrency", "daily_token_quota", "monthly_token_quota")
NO_LIMIT_WORDS = ("none", "unlimited")
TENANT_COLUMNS = ("id", "name", "enabled", "default_priority", "max_priority", "weight")
TENANT_COLUMNS += LIMIT_FIELDS
KEY_COLUMNS = ("id", "tenant", "prefix", "status", "created_at", "last_used_at", "revoked_at")


class CommandError(Exception):
    """A refusal worth one line to the operator (no traceback)."""


class AdminSettings(BaseSettings):
    """The server settings these commands need, read the way `conveyor serve` reads them."""

    model_config = SettingsConfigDict(env_prefix="CONVEYOR_", extra="ignore")

    database_url: str = ServeSettings.model_fields["database_url"].default
    key_hash_secret: str | None = None


# ==== command line ============================================================================
def register(subparsers) -> None:
    common = common_options()
    register_tenants(subparsers, common)
    register_keys(subparsers, common)
    register_db(subparsers, common)


def common_options() -> argparse.ArgumentParser:
    parent = argparse.ArgumentParser(add_help=False)
    parent.add_argument(
        "--database-url",
        default=None,
        help="database to use (default: $CONVEYOR_DATABASE_URL, else sqlite:///conveyor.db,"
        " as `conveyor serve`)",
    )
    return parent


def json_option() -> argparse.ArgumentParser:
    parent = argparse.ArgumentParser(add_help=False)
    parent.add_argument("--json", action="store_true", help="print JSON instead of a table")
    return parent


def secret_option() -> argparse.ArgumentParser:
    parent = argparse.ArgumentParser(add_help=False)
    parent.add_argument(
        "--key-hash-secret",
        default=None,
        help="the server's API key secret (default: $CONVEYOR_KEY_HASH_SECRET, else the"
        " development secret `conveyor serve` uses when none is set)",
    )
    return parent


def register_tenants(subparsers, common: argparse.ArgumentParser) -> None:
    tenants = subparsers.add_parser("tenants", help="create, list and change tenants")
    sub = tenants.add_subparsers(dest="tenants_command", required=True, metavar="COMMAND")
    parents = [common, json_option()]
    create = sub.add_parser(
        "create", parents=parents, help="add a tenant", epilog=LIMITS_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )  # fmt: skip
    create.add_argument("--name", required=True, help="letters, digits, '_', '.', '-'")
    add_tenant_field_args(create)
    create.add_argument(
        "--disable", dest="enabled", action="store_false", default=argparse.SUPPRESS,
        help="create it disabled (its keys are refused until `--enable`)",
    )  # fmt: skip
    create.set_defaults(func=runner(tenants_create))
    listing = sub.add_parser("list", parents=parents, help="show every tenant")
    listing.set_defaults(func=runner(tenants_list))
    update = sub.add_parser(
        "update", parents=parents, help="change a tenant's fields (only those given)",
        epilog=LIMITS_EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter,
    )  # fmt: skip
    update.add_argument("tenant", metavar="NAME", help="the tenant to change")
    update.add_argument("--name", default=argparse.SUPPRESS, help="rename it to this")
    add_tenant_field_args(update)
    add_enabled_switch(update)
    update.set_defaults(func=runner(tenants_update))


LIMITS_EPILOG = """\
limits (--rpm, --tpm, --max-concurrency, --daily-token-quota, --monthly-token-quota):
  a positive integer, or `none` for no limit; on `update`, `--rpm none` removes the limit.
  Unset limits on `create` are unlimited. Priorities: lower numbers are more urgent, so
  --max-priority (the most urgent a request may ask for) must be <= --default-priority."""


def add_tenant_field_args(parser: argparse.ArgumentParser) -> None:
    """The tenant's fields as flags; a flag not given stays out of `args` (argparse.SUPPRESS)."""
    unset = argparse.SUPPRESS
    parser.add_argument("--default-priority", type=int, default=unset, help="default 0")
    parser.add_argument(
        "--max-priority", type=int, default=unset, help="most urgent allowed (default 0)"
    )
    parser.add_argument(
        "--weight", type=float, default=unset, help="fair-share weight (default 1.0)"
    )
    helps = {
        "rpm": "requests per minute",
        "tpm": "tokens per minute (prompt + max_tokens reserved)",
        "max_concurrency": "requests running at once",
        "daily_token_quota": "tokens per UTC day",
        "monthly_token_quota": "tokens per UTC month",
    }
    for field, text in helps.items():
        flag = "--" + field.replace("_", "-")
        parser.add_argument(flag, type=limit_value, default=unset, metavar="N|none", help=text)


def add_enabled_switch(parser: argparse.ArgumentParser) -> None:
    switch = parser.add_mutually_exclusive_group()
    switch.add_argument(
        "--enable",
        dest="enabled",
        action="store_true",
        default=argparse.SUPPRESS,
        help="accept its keys again",
    )
    switch.add_argument(
        "--disable",
        dest="enabled",
        action="store_false",
        default=argparse.SUPPRESS,
        help="its keys are refused (within seconds on every replica) until --enable",
    )


def limit_value(text: str) -> int | None:
    """A limit flag's value: an integer, or `none` / `unlimited` for no limit."""
    if text.strip().lower() in NO_LIMIT_WORDS:
        return None
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer or 'none', got {text!r}") from None


def register_keys(subparsers, common: argparse.ArgumentParser) -> None:
    keys = subparsers.add_parser("keys", help="create, list and revoke API keys")
    sub = keys.add_subparsers(dest="keys_command", required=True, metavar="COMMAND")
    parents = [common, json_option()]
    create = sub.add_parser(
        "create", parents=[*parents, secret_option()], help="new key for a tenant (shown once)"
    )
    create.add_argument("--tenant", required=True, metavar="NAME")
    create.set_defaults(func=runner(keys_create))
    listing = sub.add_parser("list", parents=parents, help="a tenant's keys (never the keys)")
    listing.add_argument("--tenant", required=True, metavar="NAME")
    listing.set_defaults(func=runner(keys_list))
    revoke = sub.add_parser("revoke", parents=[*parents, secret_option()], help="revoke a key")
    revoke.add_argument(
        "key", metavar="KEY", help="the key's id, its prefix (e.g. cvy_ab12) or the key itself"
    )
    revoke.add_argument("--tenant", metavar="NAME", help="only look among this tenant's keys")
    revoke.set_defaults(func=runner(keys_revoke))


def register_db(subparsers, common: argparse.ArgumentParser) -> None:
    db = subparsers.add_parser("db", help="schema migrations (Alembic)")
    sub = db.add_subparsers(dest="db_command", required=True, metavar="COMMAND")
    upgrade = sub.add_parser("upgrade", parents=[common], help="migrate up (default: head)")
    upgrade.add_argument("revision", nargs="?", default="head")
    upgrade.set_defaults(func=runner(db_upgrade))
    downgrade = sub.add_parser(
        "downgrade", parents=[common], help="migrate down (default: one step; `base` drops all)"
    )
    downgrade.add_argument("revision", nargs="?", default="-1")
    downgrade.set_defaults(func=runner(db_downgrade))
    current = sub.add_parser("current", parents=[common], help="print the schema revision")
    current.set_defaults(func=runner(db_current))


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

    from gateway.tenants import ApiKeyNotFound, TenantNameTaken, TenantNotFound

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
    from gateway.tenants import KeyHasher

    if not args.key_hash_secret:
        print(
            "conveyor: warning: no --key-hash-secret or CONVEYOR_KEY_HASH_SECRET: using the"
            " development secret (keys work only on a server that has no secret set either)",
            file=sys.stderr,
        )
    return KeyHasher(args.key_hash_secret or DEV_KEY_HASH_SECRET)


# ==== tenants =================================================================================
def given_tenant_fields(args: argparse.Namespace) -> dict[str, Any]:
    from gateway.tenants import TENANT_FIELDS

    return {field: getattr(args, field) for field in TENANT_FIELDS if field in args}


async def tenants_create(args: argparse.Namespace) -> None:
    from gateway.tenants import TenantCreate, create_tenant

    data = TenantCreate(**given_tenant_fields(args))  # validated before touching the database
    async with database(args.database_url) as sessionmaker, sessionmaker.begin() as session:
        tenant = await create_tenant(session, data)
    print_record(args, tenant.model_dump(), f"Created tenant {tenant.name!r} (id {tenant.id}).")


async def tenants_list(args: argparse.Namespace) -> None:
    from gateway.tenants import list_tenants

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
    from gateway.tenants import TenantUpdate, get_tenant_by_name, update_tenant

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
async def keys_create(args: argparse.Namespace) -> None:
    from gateway.tenants import create_key, get_tenant_by_name

    hasher = key_hasher(args)
    async with database(args.database_url) as sessionmaker, sessionmaker.begin() as session:
        tenant = await get_tenant_by_name(session, args.tenant)
        key, plaintext = await create_key(session, tenant.id, hasher)
    # printed only once the transaction has committed: a shown key always exists
    if args.json:
        record = {"id": key.id, "tenant": tenant.name, "prefix": key.prefix, "key": plaintext}
        print(json.dumps(record, indent=2))
        return
    print(f"Created API key {key.id} ({key.prefix}) for tenant {tenant.name!r}:")
    print(f"  {plaintext}")
    print("Store it now: it is not stored anywhere and will not be shown again.")


async def keys_list(args: argparse.Namespace) -> None:
    from gateway.tenants import get_tenant_by_name, list_keys

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


async def keys_revoke(args: argparse.Namespace) -> None:
    from gateway.models import Tenant
    from gateway.tenants import revoke_key

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
            " every server refuses it within a few seconds."
        )
    print_record(args, row, message)


async def find_key(session, args: argparse.Namespace):
    """The one key named by id, by full plaintext (hashed with the secret) or by prefix."""
    from sqlalchemy import select

    from gateway.models import ApiKey
    from gateway.tenants import ApiKeyNotFound, get_tenant_by_name, looks_like_key

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
        raise CommandError(f"{text!r} matches keys {ids}: revoke one by its id")
    return keys[0]


def shorten_key(text: str) -> str:
    """Never echo a whole key back (it may be a live one with the wrong secret)."""
    from gateway.tenants import KEY_PREFIX_LEN, looks_like_key

    return text[:KEY_PREFIX_LEN] + "..." if looks_like_key(text) else text


def key_row(key: Any, tenant_name: str) -> dict[str, Any]:
    from gateway.tenants import ApiKeyOut

    row = ApiKeyOut.model_validate(key).model_dump(mode="json")
    row["tenant"] = tenant_name
    row["status"] = "revoked" if key.revoked_at is not None else "active"
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
