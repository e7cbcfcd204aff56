"""Operator commands on the database `conveyor serve` uses: `conveyor tenants ...`,
`conveyor keys ...` and `conveyor db ...`.

    conveyor db upgrade                                  # create or migrate the schema
    conveyor tenants create --name acme --rpm 600 --burst 20 --tpm 100000 --max-priority -1
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

from gateway.admin.commands import (
    db_current,
    db_downgrade,
    db_upgrade,
    keys_list,
    runner,
    tenants_create,
    tenants_list,
    tenants_update,
)
from gateway.admin.key_commands import keys_create, keys_revoke, keys_rotate, keys_update
from gateway.tenancy.key_models import INFERENCE_ENDPOINTS
from gateway.tenancy.limits import LIMIT_FIELDS, SCRIPT_LIMIT_FIELDS, LimitField

NO_LIMIT_WORDS = ("none", "unlimited")


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


NULLABLE_FLAGS = ", ".join(limit.flag for limit in LIMIT_FIELDS if limit.nullable)


DEFAULTED_FLAGS = ", ".join(limit.flag for limit in LIMIT_FIELDS if not limit.nullable)


LIMITS_EPILOG = f"""\
limits ({NULLABLE_FLAGS}):
  a positive integer, or `none` for no limit; on `update`, `--rpm none` removes the limit.
  Unset limits on `create` are unlimited. {DEFAULTED_FLAGS}: a number, never `none`;
  unset, its default (see above).
  Priorities: lower numbers are more urgent, so --max-priority (the most urgent a request
  may ask for) must be <= --default-priority."""


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
    for limit in LIMIT_FIELDS:
        add_limit_arg(parser, limit)


def add_limit_arg(parser: argparse.ArgumentParser, limit: LimitField) -> None:
    if limit.nullable:
        kind, metavar = limit_value, "N|none"
    else:
        kind, metavar = int, "N"
    parser.add_argument(
        limit.flag, type=kind, default=argparse.SUPPRESS, metavar=metavar, help=limit.help
    )


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
    keys = subparsers.add_parser("keys", help="create, list, change, rotate and revoke API keys")
    sub = keys.add_subparsers(dest="keys_command", required=True, metavar="COMMAND")
    parents = [common, json_option()]
    create = sub.add_parser(
        "create", parents=[*parents, secret_option()], help="new key for a tenant (shown once)"
    )
    create.add_argument("--tenant", required=True, metavar="NAME")
    add_key_field_args(create)
    create.set_defaults(func=runner(keys_create))
    listing = sub.add_parser("list", parents=parents, help="a tenant's keys (never the keys)")
    listing.add_argument("--tenant", required=True, metavar="NAME")
    listing.set_defaults(func=runner(keys_list))
    changing = [*parents, secret_option(), redis_option()]
    update = sub.add_parser("update", parents=changing, help="change a key's fields (given ones)")
    add_key_argument(update)
    add_key_field_args(update)
    update.set_defaults(func=runner(keys_update))
    rotate = sub.add_parser(
        "rotate", parents=changing, help="replace a key; the old one works for --grace-seconds"
    )
    add_key_argument(rotate)
    rotate.add_argument("--grace-seconds", type=int, default=0, metavar="S",
                        help="how long the old key keeps working (default 0)")  # fmt: skip
    rotate.set_defaults(func=runner(keys_rotate))
    revoke = sub.add_parser("revoke", parents=changing, help="revoke a key")
    add_key_argument(revoke)
    revoke.set_defaults(func=runner(keys_revoke))


def add_key_argument(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "key", metavar="KEY", help="the key's id, its prefix (e.g. cvy_ab12) or the key itself"
    )
    parser.add_argument("--tenant", metavar="NAME", help="only look among this tenant's keys")


def redis_option() -> argparse.ArgumentParser:
    parent = argparse.ArgumentParser(add_help=False)
    parent.add_argument(
        "--redis-url", default=None,
        help="tell running servers at once (default: $CONVEYOR_REDIS_URL; none: within 2 s)",
    )  # fmt: skip
    return parent


def add_key_field_args(parser: argparse.ArgumentParser) -> None:
    """A key's fields as flags; `none` clears one (on update). Not given: not in `args`."""
    unset = argparse.SUPPRESS
    parser.add_argument("--name", default=unset, help="a label for people")
    parser.add_argument("--expires-at", type=optional_text, default=unset, metavar="TIME|none",
                        help="ISO 8601 time from which it is refused")  # fmt: skip
    parser.add_argument("--duration", default=unset, help='expires this long from now: "30d"')
    parser.add_argument("--models", type=optional_list, default=unset, metavar="A,B|none",
                        help="served names or glob patterns it may use (default: all)")  # fmt: skip
    parser.add_argument("--endpoints", type=optional_list, default=unset, metavar="A,B|none",
                        help=f"of {', '.join(INFERENCE_ENDPOINTS)} (default: all)")  # fmt: skip
    for limit in SCRIPT_LIMIT_FIELDS:
        parser.add_argument(limit.flag, type=limit_value, default=unset, metavar="N|none",
                            help=f"the key's own: {limit.help}")  # fmt: skip


def optional_text(text: str) -> str | None:
    return None if text.strip().lower() in NO_LIMIT_WORDS else text


def optional_list(text: str) -> list[str] | None:
    if text.strip().lower() in NO_LIMIT_WORDS:
        return None
    return [item.strip() for item in text.split(",") if item.strip()]


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
