"""`conveyor serve`: the OpenAI-compatible HTTP server.

Every flag is optional on the command line; what is not given comes from `CONVEYOR_*`
environment variables, then from the defaults in `gateway.settings.ServeSettings`.
"""

from __future__ import annotations

import argparse
import logging

from pydantic import ValidationError

from runtime.config import EngineConfig

log = logging.getLogger(__name__)


def register(subparsers) -> None:
    parser = subparsers.add_parser(
        "serve",
        help="serve the OpenAI-compatible API",
        description="Every flag can also be set as CONVEYOR_<FLAG> (e.g. CONVEYOR_REDIS_URL).",
    )
    add_serve_args(parser)
    EngineConfig.add_cli_args(parser)
    leave_unset_flags_out(parser)
    parser.set_defaults(func=cmd_serve)


def add_serve_args(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("server")
    group.add_argument("--host", help="address to bind (default 127.0.0.1)")
    group.add_argument("--port", type=int, help="port (default 8000)")
    group.add_argument("--database-url", help="default sqlite:///conveyor.db")
    group.add_argument("--no-auto-migrate", dest="auto_migrate", action="store_false")
    group.add_argument("--redis-url", help="default: in-process fakeredis")
    group.add_argument("--rate-limit-on-error", choices=["open", "closed"])
    group.add_argument(
        "--auth-stale-for",
        type=float,
        metavar="SECONDS",
        help="while the database is unreachable, keys valid at their last check keep working"
        " this long (default 300; 0: refuse them with 503)",
    )
    group.add_argument("--key-hash-secret", help="HMAC secret for API keys")
    group.add_argument("--admin-tokens", help="comma-separated bearer tokens for /admin")
    group.add_argument("--max-body-bytes", type=int)
    group.add_argument("--drain-timeout", type=float, help="seconds to finish in-flight work")
    group.add_argument("--max-waiting-requests", type=int)
    group.add_argument("--audit-spool-path")
    group.add_argument(
        "--no-audit", dest="audit", action="store_false", help="write no audit log (benchmarks)"
    )
    group.add_argument("--audit-retention-days", type=float, help="prune older audit records")
    group.add_argument(
        "--log-level",
        type=str.lower,
        choices=["debug", "info", "warning", "error", "critical"],
        help="default: the level of `conveyor --log-level`",
    )
    group.add_argument(
        "--no-demo-tenant",
        dest="create_demo_tenant",
        action="store_false",
        help="do not create a demo tenant on a first start",
    )


def leave_unset_flags_out(parser: argparse.ArgumentParser) -> None:
    """A flag that is not given must not hide its environment variable."""
    for action in parser._actions:
        if action.dest not in ("help", "func"):
            action.default = argparse.SUPPRESS


def settings_from_args(args: argparse.Namespace):
    from gateway.settings import ServeSettings

    # None: `conveyor --log-level` left at its default, which must not hide CONVEYOR_LOG_LEVEL
    given = {
        k: v for k, v in vars(args).items() if k in ServeSettings.model_fields and v is not None
    }
    return ServeSettings(**given)


def cmd_serve(args: argparse.Namespace) -> int:
    from gateway import lifecycle
    from gateway.app import create_app

    try:
        settings = settings_from_args(args)
    except ValidationError as error:
        print(f"conveyor serve: invalid settings:\n{error}")
        return 2
    if settings.log_level is not None:
        logging.getLogger().setLevel(settings.log_level.upper())
    # Not web.run_app: it stops listening at the first signal and cuts streams after its own
    # timeout; lifecycle keeps answering (503) while in-flight work drains.
    lifecycle.run(create_app(settings), settings)
    return 0
