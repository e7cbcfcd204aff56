"""`conveyor bench structured`: constrained output tok/s against unconstrained at the same
concurrency, on one loaded engine. The same chat prompts run three times: every request free
(ignore_eos), every request under a JSON schema long enough that no answer completes before
max_tokens (so both runs produce exactly the same number of tokens per request and batch the
same way), and half of each. Grammar compilation is measured apart (the gateway compiles
before admission, off the engine step); the target is constrained >= 0.8x unconstrained."""

from __future__ import annotations

import argparse
import json
import platform
import time

from benchmarks.common import (
    add_common_args,
    apply_threads,
    build_engine,
    format_table,
    progress,
    ratio,
    save_result,
)
from runtime.config import EngineConfig
from scheduler.request import GrammarSpec, SamplingParams

TARGET = 0.8
LONG_SCHEMA = {  # a list of people longer than any max_tokens here: every answer is cut
    "type": "object",
    "properties": {
        "people": {
            "type": "array",
            "minItems": 200,
            "items": {
                "type": "object",
                "properties": {
                    "name": {"type": "string", "maxLength": 24},
                    "age": {"type": "integer", "minimum": 0, "maximum": 120},
                    "city": {"type": "string", "maxLength": 24},
                },
                "required": ["name", "age", "city"],
            },
        }
    },
    "required": ["people"],
}
TOPICS = ["a village", "a school", "a ship crew", "a football team", "a family", "an office"]


def register(sub) -> None:
    p = sub.add_parser(
        "structured",
        help="constrained (JSON schema) output tok/s vs unconstrained at the same concurrency",
    )
    p.add_argument("--num-prompts", type=int, default=32)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--rounds", type=int, default=1, help="each mode runs this many times")
    add_common_args(p)
    EngineConfig.add_cli_args(p)
    p.set_defaults(func=cmd_structured)


def cmd_structured(args: argparse.Namespace) -> int:
    apply_threads(args)
    engine = build_engine(args)
    result = run_structured_bench(engine, args)
    print(format_table(["mode", "requests", "output tokens", "seconds", "tok/s", "vs free"],
                       result["table"]))  # fmt: skip
    print(json.dumps({k: v for k, v in result.items() if k != "table"}, indent=2))
    save_result(args.save_result, result)
    return 0


def prompts_for(engine, num_prompts: int) -> list[list[int]]:
    return [
        engine.tokenizer.apply_chat_template(
            [{"role": "user", "content": f"List the people of {TOPICS[i % len(TOPICS)]} as JSON."}]
        )
        for i in range(num_prompts)
    ]


def params_for(mode: str, num_prompts: int, output_len: int, spec: GrammarSpec):
    free = SamplingParams(max_tokens=output_len, temperature=0.0, ignore_eos=True)
    constrained = SamplingParams(max_tokens=output_len, temperature=0.0, grammar=spec)
    if mode == "free":
        return [free] * num_prompts
    if mode == "constrained":
        return [constrained] * num_prompts
    return [constrained if i % 2 else free for i in range(num_prompts)]


def timed_run(engine, prompts, params) -> tuple[float, int, int]:
    """(seconds, output tokens, requests cut by length)."""
    start = time.perf_counter()
    requests = engine.generate(prompts, params)
    seconds = time.perf_counter() - start
    num_cut = sum(r.finish_reason == "length" for r in requests)
    return seconds, sum(r.num_output_tokens for r in requests), num_cut


def run_structured_bench(engine, args: argparse.Namespace) -> dict:
    spec = GrammarSpec("json_schema", json.dumps(LONG_SCHEMA))
    first = engine.structured.prepare(spec)  # cold: vocabulary read + compile
    again = engine.structured.prepare(spec)
    prompts = prompts_for(engine, args.num_prompts)
    engine.generate(prompts[:2], params_for("mixed", 2, 4, spec))  # warm-up
    rows, rates = [], {}
    for mode in ("free", "constrained", "mixed"):
        runs = []
        for _ in range(args.rounds):
            progress(f"structured: {mode}")
            runs.append(
                timed_run(engine, prompts, params_for(mode, len(prompts), args.output_len, spec))
            )
        seconds = min(run[0] for run in runs)
        num_tokens = runs[0][1]
        rates[mode] = num_tokens / seconds
        rows.append(
            [
                mode,
                len(prompts),
                num_tokens,
                seconds,
                rates[mode],
                ratio(rates[mode], rates["free"]),
            ]
        )
    return {
        "machine": platform.processor() or platform.machine(),
        "device": str(engine.runner.device),
        "dtype": str(engine.runner.dtype).removeprefix("torch."),
        "max_num_seqs": engine.config.max_num_seqs,
        "num_prompts": len(prompts),
        "output_len": args.output_len,
        "grammar_compile_ms": first.compile_s * 1000,
        "grammar_cache_hit_ms": again.compile_s * 1000,
        "grammar_size_bytes": first.size_bytes,
        "constrained_vs_free": ratio(rates["constrained"], rates["free"]),
        "mixed_vs_free": ratio(rates["mixed"], rates["free"]),
        "target": TARGET,
        "table": rows,
    }
