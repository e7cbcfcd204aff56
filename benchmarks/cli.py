"""`conveyor bench …`: every benchmark's command line.

The runs live beside this file: offline.py (throughput against transformers), priority.py
(latency under load, preemption, tenant fair share), serve.py (load over HTTP on any
OpenAI-compatible server), overhead.py (what the HTTP path adds to TTFT), gpu.py (Triton
kernels against their references, on a CUDA machine), step.py (the host cost of a decode
step on a near-zero model; `bench projection`, the greedy projection alone) and structured.py (constrained against free output tok/s).
"""

from __future__ import annotations

import argparse

from benchmarks.common import add_common_args, apply_threads, save_result
from runtime.config import EngineConfig


def register_bench(bench_subparsers) -> None:
    """Adds every `conveyor bench <name>`."""
    from benchmarks import (
        gpu,
        gpu_quant,
        overhead,
        quant,
        quant_accuracy,
        serve,
        spec_sweep,
        step,
        structured,
    )

    register_offline(bench_subparsers)
    register_priority(bench_subparsers)
    serve.register(bench_subparsers)
    overhead.register(bench_subparsers)
    gpu.register(bench_subparsers)
    gpu_quant.register(bench_subparsers)
    spec_sweep.register(bench_subparsers)
    step.register(bench_subparsers)
    structured.register(bench_subparsers)
    quant.register(bench_subparsers)
    quant_accuracy.register(bench_subparsers)


def register_offline(sub) -> None:
    p = sub.add_parser(
        "offline",
        help="throughput: Conveyor continuous and static vs transformers generate and generate_batch",
    )
    p.add_argument("--num-prompts", type=int, default=128)
    p.add_argument("--input", default=None, help="JSONL requests (as `conveyor generate` reads)")
    p.add_argument("--min-prompt-len", type=int, default=16)
    p.add_argument("--max-prompt-len", type=int, default=512)
    p.add_argument("--min-output-len", type=int, default=8)
    p.add_argument("--max-output-len", type=int, default=512)
    p.add_argument("--skip-transformers", action="store_true", help="run only Conveyor")
    p.add_argument(
        "--rounds",
        type=int,
        default=1,
        help="pairs of Conveyor continuous and generate_batch runs; the target uses the median "
        "of the pairs' ratios",
    )
    add_common_args(p)
    EngineConfig.add_cli_args(p)  # its --seed also seeds the synthetic workload
    p.set_defaults(func=cmd_offline)


def register_priority(sub) -> None:
    p = sub.add_parser(
        "priority",
        help="interactive TTFT under batch load, preemption modes, tenant fair share",
    )
    p.add_argument("--num-batch-requests", type=int, default=None, help="default: 3 x max-num-seqs")
    p.add_argument("--batch-prompt-len", type=int, default=128)
    p.add_argument("--batch-output-len", type=int, default=256)
    p.add_argument("--batch-priority", type=int, default=10)
    p.add_argument("--num-interactive", type=int, default=20)
    p.add_argument("--interactive-interval", type=float, default=0.5, help="seconds between")
    p.add_argument("--interactive-prompt-len", type=int, default=64)
    p.add_argument("--interactive-output-len", type=int, default=16)
    p.add_argument(
        "--preemption-modes",
        default="auto,swap,recompute",
        help="comma-separated modes: the loaded phase runs once per mode",
    )
    p.add_argument(
        "--num-fairness-requests",
        type=int,
        default=None,
        help="per tenant; default 2 x max-num-seqs",
    )
    p.add_argument("--fairness-prompt-len", type=int, default=64)
    p.add_argument(
        "--fairness-output-len",
        type=int,
        default=64,
        help="mean; lengths spread uniformly over half to 1.5 times it, the same list per tenant",
    )
    add_common_args(p)
    EngineConfig.add_cli_args(p)
    # a small running-slot cap saturates the engine with a workload a 2-core CPU can run
    p.set_defaults(func=cmd_priority, max_num_seqs=16)


def cmd_offline(args: argparse.Namespace) -> int:
    from benchmarks.offline import print_offline_report, run_offline_bench

    apply_threads(args)
    result = run_offline_bench(args)
    print_offline_report(result)
    save_result(args.save_result, result)
    return 0


def cmd_priority(args: argparse.Namespace) -> int:
    from benchmarks.priority import run_priority_bench
    from benchmarks.priority_report import print_priority_report

    apply_threads(args)
    result = run_priority_bench(args)
    print_priority_report(result)
    save_result(args.save_result, result)
    return 0
