"""`conveyor` command line. Each command family lives in its own module with a `register(subparsers)`
function; this file only wires them together."""

from __future__ import annotations

import argparse
import importlib
import json
import logging
import os
import sys
from pathlib import Path

# modules with `register(subparsers)`, by the commands each adds
COMMAND_MODULES: dict[str, tuple[str, ...]] = {
    "gateway.serve": ("serve",),
    "gateway.admin.cli": ("tenants", "keys", "db"),
    "gateway.models_cli": ("models",),
}
# modules with `register_bench(bench_subparsers)`: each adds `conveyor bench <name>`
BENCH_MODULES: list[str] = ["benchmarks.cli"]


def register_generate(sub) -> None:
    from runtime.config import EngineConfig

    p = sub.add_parser("generate", help="offline generation: JSONL in, JSONL out")
    p.add_argument("--input", required=True, help="JSONL file of requests ('-' for stdin)")
    p.add_argument("--output", required=True, help="JSONL file of results ('-' for stdout)")
    p.add_argument("--events", action="store_true", help="add each request's delay events")
    p.add_argument("--no-progress", action="store_true")
    EngineConfig.add_cli_args(p)
    p.set_defaults(func=cmd_generate)


def cmd_generate(args: argparse.Namespace) -> int:
    from runtime.config import EngineConfig
    from runtime.engine import Engine
    from runtime.offline import run_offline

    lines = (
        sys.stdin.readlines() if args.input == "-" else Path(args.input).read_text().splitlines()
    )
    engine = Engine(EngineConfig.from_args(args))
    results = run_offline(engine, lines, with_events=args.events, progress=not args.no_progress)
    text = "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in results)
    if args.output == "-":
        sys.stdout.write(text)
    else:
        Path(args.output).write_text(text)
    num_errors = sum(1 for r in results if "error" in r)
    print(
        f"{len(results) - num_errors} done, {num_errors} with errors -> {args.output}",
        file=sys.stderr,
    )
    return 0


def build_parser(command: str | None = None) -> argparse.ArgumentParser:
    """The whole parser, or (given the command about to run) only what that command needs, so
    that `conveyor tenants …` does not pay for importing the engine."""
    parser = argparse.ArgumentParser(
        prog="conveyor", description="Multi-tenant LLM serving gateway"
    )
    parser.add_argument("--log-level", help="default: CONVEYOR_LOG_LEVEL, else WARNING")
    sub = parser.add_subparsers(dest="command", required=True)

    def wanted(name: str) -> bool:
        return command in (None, name)

    if wanted("generate"):
        register_generate(sub)
    if wanted("bench"):
        bench = sub.add_parser("bench", help="benchmarks").add_subparsers(
            dest="bench", required=True
        )
        for name in BENCH_MODULES:
            importlib.import_module(name).register_bench(bench)
    for name, commands in COMMAND_MODULES.items():
        if any(wanted(c) for c in commands):
            importlib.import_module(name).register(sub)
    return parser


def _command_in(argv: list[str]) -> str | None:
    """The first argument naming a command (None: build everything, e.g. for --help)."""
    known = {"generate", "bench", *(c for cs in COMMAND_MODULES.values() for c in cs)}
    return next((arg for arg in argv if arg in known), None)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = build_parser(_command_in(argv)).parse_args(argv)
    level = args.log_level or os.environ.get("CONVEYOR_LOG_LEVEL") or "WARNING"
    logging.basicConfig(
        level=level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    return int(args.func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
