"""The offline benchmarks' workload (prompts of random token ids or a `conveyor generate` file,
output lengths, greedy and ignore_eos) and the record of one system's run.
"""

from __future__ import annotations

import argparse
import random
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from benchmarks.common import (
    log_uniform_lengths,
    progress,
    random_prompt,
)
from scheduler.request import SamplingParams


@dataclass
class Workload:
    prompts: list[list[int]]
    output_lens: list[int]
    source: str

    @property
    def num_requests(self) -> int:
        return len(self.prompts)

    def summary(self) -> dict:
        prompt_lens = [len(p) for p in self.prompts]
        return {
            "source": self.source,
            "num_requests": self.num_requests,
            "prompt_tokens": sum(prompt_lens),
            "output_tokens": sum(self.output_lens),
            "prompt_len_min_max": [min(prompt_lens), max(prompt_lens)],
            "output_len_min_max": [min(self.output_lens), max(self.output_lens)],
        }


@dataclass
class SystemRun:
    name: str
    seconds: float
    output_tokens: int
    details: dict = field(default_factory=dict)
    bound: Any = field(default=None, repr=False)  # a benchmarks.bound.StepBound for Conveyor

    @property
    def output_tokens_per_s(self) -> float:
        return self.output_tokens / self.seconds


# ---- workload -------------------------------------------------------------------------------
def synthetic_workload(args: argparse.Namespace, vocab_size: int) -> Workload:
    rng = random.Random(args.seed)
    n = args.num_prompts
    prompt_lens = log_uniform_lengths(rng, args.min_prompt_len, args.max_prompt_len, n)
    output_lens = log_uniform_lengths(rng, args.min_output_len, args.max_output_len, n)
    prompts = [random_prompt(rng, length, vocab_size) for length in prompt_lens]
    source = (
        f"synthetic seed={args.seed} prompt {args.min_prompt_len}-{args.max_prompt_len} "
        f"output {args.min_output_len}-{args.max_output_len} log-uniform"
    )
    return Workload(prompts, output_lens, source)


def file_workload(engine, path: str) -> Workload:
    """The requests of a `conveyor generate` JSONL file; lines that cannot run are skipped."""
    from runtime.offline import parse_line

    lines = [line for line in Path(path).read_text().splitlines() if line.strip()]
    items = [parse_line(engine, i, line) for i, line in enumerate(lines)]
    for item in items:
        if item.error:
            progress(f"skipped: {item.error}")
    good = [item for item in items if item.error is None]
    prompts = [item.prompt_token_ids for item in good]
    return Workload(prompts, [item.params.max_tokens for item in good], f"file {path}")


def benchmark_params(max_tokens: int) -> SamplingParams:
    """Greedy and ignore_eos, so every system produces exactly the asked-for tokens."""
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
