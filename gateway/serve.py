"""`conveyor serve`: the OpenAI-compatible HTTP server.

Every flag is optional on the command line; what is not given comes from `CONVEYOR_*`
environment variables, then from the defaults in `gateway.settings.ServeSettings`.
"""

from __future__ import annotations

import argparse
import logging

from pydantic import ValidationError

from runtime.config import EngineConfig
from runtime.flags import add_flags

log = logging.getLogger(__name__)


def register(subparsers) -> None:
    from gateway.settings import ServeSettings

    parser = subparsers.add_parser(
        "serve",
        help="serve the OpenAI-compatible API",
        description="Every flag can also be set as CONVEYOR_<FLAG> (e.g. CONVEYOR_REDIS_URL).",
    )
    server_fields = [
        name for name in ServeSettings.model_fields if name not in EngineConfig.model_fields
    ]
    add_flags(parser.add_argument_group("server"), ServeSettings, server_fields, defaults=False)
    add_flags(parser.add_argument_group("engine"), EngineConfig, defaults=False)
    parser.set_defaults(func=cmd_serve)


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
