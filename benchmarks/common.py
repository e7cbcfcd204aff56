"""What every `conveyor bench …` shares: engine building, workloads of random token ids, the
matmul-rate probe, percentiles, tables and result files."""

from __future__ import annotations

import argparse
import json
import math
import random
import sys
from pathlib import Path
from typing import Any

import torch

from runtime.config import EngineConfig


def add_common_args(p) -> None:
    p.add_argument("--save-result", default=None, metavar="PATH", help="write the result JSON")
    p.add_argument(
        "--num-threads", type=int, default=None, help="torch intra-op threads (default: torch's)"
    )


def apply_threads(args: argparse.Namespace) -> None:
    if args.num_threads:
        torch.set_num_threads(args.num_threads)


def build_engine(args: argparse.Namespace):
    from runtime.engine import Engine

    return Engine(EngineConfig.from_args(args))


def abort_all(engine) -> None:
    for request_id in list(engine.scheduler.requests):
        engine.abort(request_id)


def log_uniform_lengths(rng: random.Random, low: int, high: int, count: int) -> list[int]:
    """Integers in [low, high] whose logarithm is uniform."""
    log_low, log_high = math.log(low), math.log(high + 1)
    return [min(high, int(math.exp(rng.uniform(log_low, log_high)))) for _ in range(count)]


def random_prompt(rng: random.Random, length: int, vocab_size: int) -> list[int]:
    """Random token ids, away from the special tokens at the start of the vocabulary."""
    low = min(256, vocab_size // 2)
    return [rng.randrange(low, vocab_size) for _ in range(length)]


def percentile(values: list[float], q: float) -> float | None:
    """Linear-interpolated q-th percentile (0..100); None for no values."""
    if not values:
        return None
    ordered = sorted(values)
    rank = (len(ordered) - 1) * q / 100
    low, high = math.floor(rank), math.ceil(rank)
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)


def ratio(numerator: float | None, denominator: float | None) -> float | None:
    if numerator is None or not denominator:
        return None
    return numerator / denominator


def format_table(header: list[str], rows: list[list[Any]]) -> str:
    cells = [header] + [[_cell(v) for v in row] for row in rows]
    widths = [max(len(row[i]) for row in cells) for i in range(len(header))]
    lines = [" | ".join(c.ljust(w) for c, w in zip(row, widths)) for row in cells]
    lines.insert(1, "-+-".join("-" * w for w in widths))
    return "\n".join(lines)


def _cell(value: Any) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.3g}" if abs(value) < 10 else f"{value:.1f}"
    return str(value)


def progress(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def save_result(path: str | None, result: dict) -> None:
    if path:
        Path(path).write_text(json.dumps(result, indent=2) + "\n")
        progress(f"result written to {path}")
