"""`conveyor bench spec-sweep`: speculative decoding from concurrency 1 to saturation, the goodput
policy against fixed k (the rule other engines use) and against no speculation, on two workloads:
"copy" (reproduce a given source file: much to copy), "json" (re-emit a document with one change)
and "chat" (a story: little to copy); "tips" and "water" are two more chats, asked for by
--workloads.

One engine in one process runs every point: for each workload and concurrency C, C copies of the
workload's prompt run together (`Engine.generate`, greedy, `ignore_eos`), in the --modes (all
three by default) one after the other in an order shuffled each round, --repeats rounds: off (the
scheduler's drafter removed), the policy (the engine's own), fixed k (every row that may speculate
gets --num-speculative-tokens drafts). The prompt's prefix is cached first (the draft model's too),
so that no mode pays its prefill alone. Reports output tok/s (the fastest round of each mode), the
speedup over off, the median of each round's speedup (a round's modes ran a minute apart at most:
on a shared host that median is the figure to quote where speedups are near 1), the acceptance
rate and the k the policy chose, as a table and an SVG plot.

    conveyor bench spec-sweep --speculative ngram --concurrency 1,4,16 --plot docs/images/spec-sweep.svg
    conveyor bench spec-sweep --model qwen2.5-coder-1.5b-instruct --speculative draft \
        --draft-model qwen2.5-coder-0.5b-instruct --workloads copy,chat,tips,water \
        --modes off,policy --concurrency 1 --repeats 6
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time
from pathlib import Path

from benchmarks.common import format_table, save_result
from runtime.config import EngineConfig
from runtime.engine import Engine
from runtime.models.catalog import DEFAULT_MODEL
from runtime.spec.policy import FixedK
from scheduler.request import SamplingParams

# the copy workload's text: 40 lines of Python, fixed (it was policy.py's head, which changed)
COPY_SOURCE = Path(__file__).resolve().parent / "data" / "spec-copy-source.txt"
# the json workload's document: a dozen store items; the answer re-emits it with one price changed
JSON_SOURCE = COPY_SOURCE.with_name("spec-json-source.json")
MODES = ("off", "policy", "fixed k")
COLORS = {"policy": "#1b7837", "fixed k": "#c51b7d"}
DASHES = {"copy": "", "json": "2,3", "chat": "6,4", "tips": "1,3", "water": "8,3,2,3"}
DEFAULT_WORKLOADS = ("copy", "json", "chat")


def prompts() -> dict[str, str]:
    source = COPY_SOURCE.read_text().rstrip("\n")
    document = JSON_SOURCE.read_text().rstrip("\n")
    return {
        "copy": f"Output the following Python code exactly, unchanged:\n\n{source}",
        "json": f"Here is a JSON document:\n\n{document}\n\nOutput the same JSON document with one "
        'change: the price of "fig" is 9.99. Output only the JSON.',
        "chat": "Write a short story about a lighthouse keeper who finds a message in a bottle.",
        "tips": "Give me three tips for working from home.",
        "water": "Explain the water cycle to a ten-year-old.",
    }


def run_point(engine: Engine, prompt_ids: list[int], concurrency: int, tokens: int) -> dict:
    spec = engine.speculator
    before = dict(spec.num_rows_per_k) if spec else {}
    drafted, accepted = _counts(engine)
    params = SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True)
    start = time.perf_counter()
    engine.generate([prompt_ids] * concurrency, params)
    seconds = time.perf_counter() - start
    drafted, accepted = (a - b for a, b in zip(_counts(engine), (drafted, accepted), strict=True))
    ks = {k: n - before.get(k, 0) for k, n in (spec.num_rows_per_k if spec else {}).items()}
    return {
        "tok_s": concurrency * tokens / seconds,
        "acceptance": accepted / drafted if drafted else None,
        "k_rows": {k: n for k, n in sorted(ks.items()) if n},
    }


def _counts(engine: Engine) -> tuple[int, int]:
    stats = engine.speculator.stats if engine.speculator else None
    return (stats.num_draft_tokens, stats.num_accepted_tokens) if stats else (0, 0)


def sweep(
    engine: Engine,
    concurrencies: list[int],
    tokens: int,
    k: int,
    repeats: int,
    workloads: tuple[str, ...] = DEFAULT_WORKLOADS,
    modes: tuple[str, ...] = MODES,
) -> list[dict]:
    """Each point: the modes in an order shuffled each round (seeded), `repeats` rounds; each
    mode keeps its fastest round (the machine's noise only slows a run down) and the median of
    its rounds' speedups over the same round's off. The prompt's prefix is cached first."""
    policy, drafter = engine.speculator.policy, engine.scheduler.drafter
    texts, order = prompts(), random.Random(0)
    points = []
    for workload in workloads:
        ids = engine.tokenizer.apply_chat_template([{"role": "user", "content": texts[workload]}])
        warm_caches(engine, ids, k)
        for concurrency in concurrencies:
            rounds = []
            for _ in range(repeats):
                shuffled = order.sample(modes, len(modes))
                measured = {}
                for mode in shuffled:
                    engine.scheduler.drafter = None if mode == "off" else drafter
                    engine.speculator.policy = FixedK(k) if mode == "fixed k" else policy
                    measured[mode] = run_point(engine, ids, concurrency, tokens)
                rounds.append(measured)
            engine.scheduler.drafter, engine.speculator.policy = drafter, policy
            points.append({"workload": workload, "concurrency": concurrency} | summary(rounds))
    return points


def summary(rounds: list[dict[str, dict]]) -> dict[str, dict]:
    """Rounds of {mode: measured} -> {mode: its fastest round, with the median of its rounds'
    speedups over off ("median_speedup")}."""
    modes = {}
    for mode in rounds[0]:
        modes[mode] = dict(max((r[mode] for r in rounds), key=lambda m: m["tok_s"]))
        if mode != "off" and "off" in rounds[0]:
            ratios = [r[mode]["tok_s"] / r["off"]["tok_s"] for r in rounds]
            modes[mode]["median_speedup"] = statistics.median(ratios)
    return modes


def warm_caches(engine: Engine, ids: list[int], k: int) -> None:
    """Every mode gets the prompt's prefix cached, the target's and a draft model's (a fixed-k
    request of a few tokens makes the draft catch up on the prompt)."""
    policy = engine.speculator.policy
    engine.speculator.policy = FixedK(k)
    try:
        engine.generate([ids], SamplingParams(max_tokens=3, temperature=0.0))
    finally:
        engine.speculator.policy = policy


def table(points: list[dict]) -> str:
    modes = [m for m in MODES[1:] if m in points[0]]
    rows = []
    for p in points:
        off = p["off"]["tok_s"]
        cells = [p["workload"], p["concurrency"], f"{off:.1f}"]
        for mode in modes:
            r = p[mode]
            acceptance = "" if r["acceptance"] is None else f", {r['acceptance']:.2f}"
            median = f", median {r['median_speedup']:.2f}x" if "median_speedup" in r else ""
            cells.append(f"{r['tok_s']:.1f} ({r['tok_s'] / off:.2f}x{acceptance}{median})")
        k_rows = p["policy"]["k_rows"] if "policy" in p else {}
        cells.append(", ".join(f"{k}: {n}" for k, n in k_rows.items()))
        rows.append(cells)
    header = ["workload", "C", "off tok/s"]
    header += [{"policy": "policy (speedup, acceptance)", "fixed k": "fixed k"}[m] for m in modes]
    return format_table(header + ["k chosen"], rows)


def svg_plot(points: list[dict], title: str) -> str:
    """Speedup over off against concurrency (log scale): a line per workload and mode."""
    width, height, left, right, top, bottom = 640, 380, 60, 150, 40, 50
    concurrencies = sorted({p["concurrency"] for p in points})
    modes = [m for m in MODES[1:] if m in points[0]]
    speedups = [p[m]["tok_s"] / p["off"]["tok_s"] for p in points for m in modes]
    low, high = min(0.5, min(speedups)), max(1.5, max(speedups))

    def x_of(c: int) -> float:
        span = max(1, len(concurrencies) - 1)
        return left + (width - left - right) * concurrencies.index(c) / span

    def y_of(s: float) -> float:
        return top + (height - top - bottom) * (high - s) / (high - low)

    parts = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" '
             f'font-family="sans-serif" font-size="12">',
             f'<rect width="{width}" height="{height}" fill="white"/>',
             f'<text x="{left}" y="20" font-size="14">{title}</text>']  # fmt: skip
    ticks = [round(low + (high - low) * i / 5, 2) for i in range(6)]
    for s in ticks + [1.0]:
        style = 'stroke="#999" stroke-dasharray="2,3"' if s == 1.0 else 'stroke="#eee"'
        parts.append(f'<line x1="{left}" x2="{width - right}" y1="{y_of(s):.1f}" '
                     f'y2="{y_of(s):.1f}" {style}/>')  # fmt: skip
        parts.append(
            f'<text x="{left - 8}" y="{y_of(s) + 4:.1f}" text-anchor="end">{s:.2f}x</text>'
        )
    for c in concurrencies:
        parts.append(f'<text x="{x_of(c):.1f}" y="{height - bottom + 18}" '
                     f'text-anchor="middle">{c}</text>')  # fmt: skip
    parts.append(f'<text x="{(left + width - right) / 2}" y="{height - 12}" '
                 f'text-anchor="middle">concurrent requests</text>')  # fmt: skip
    legend_y = top + 10
    for workload in DASHES:
        for mode in modes:
            line = [(x_of(p["concurrency"]), y_of(p[mode]["tok_s"] / p["off"]["tok_s"]))
                    for p in points if p["workload"] == workload]  # fmt: skip
            if not line:
                continue
            path = " ".join(f"{x:.1f},{y:.1f}" for x, y in line)
            stroke = f'stroke="{COLORS[mode]}" stroke-width="2" fill="none"'
            dash = f' stroke-dasharray="{DASHES[workload]}"' if DASHES[workload] else ""
            parts.append(f'<polyline points="{path}" {stroke}{dash}/>')
            parts += [f'<circle cx="{x:.1f}" cy="{y:.1f}" r="3" fill="{COLORS[mode]}"/>'
                      for x, y in line]  # fmt: skip
            lx = width - right + 12
            parts.append(f'<line x1="{lx}" x2="{lx + 24}" y1="{legend_y}" y2="{legend_y}" '
                         f"{stroke}{dash}/>")  # fmt: skip
            parts.append(f'<text x="{lx + 30}" y="{legend_y + 4}">{workload}, {mode}</text>')
            legend_y += 18
    parts.append("</svg>")
    return "\n".join(parts) + "\n"


def register(sub) -> None:
    p = sub.add_parser("spec-sweep", help="speculation: policy vs fixed k vs off, by concurrency")
    p.add_argument("--model", default=None, help="as `conveyor serve --model` (default model)")
    p.add_argument("--speculative", default="ngram", choices=["ngram", "draft"])
    p.add_argument("--draft-model", default=None)
    p.add_argument(
        "--draft-prompt-lookup", action=argparse.BooleanOptionalAction, default=None,
        help="as `conveyor serve`'s (default: its default)",
    )  # fmt: skip
    p.add_argument(
        "--num-speculative-tokens",
        type=int,
        default=None,
        help="as `conveyor serve`'s (default: 8 for ngram, 7 for draft)",
    )
    p.add_argument("--concurrency", default="1,4,16", help="comma-separated")
    p.add_argument(
        "--workloads", default=",".join(DEFAULT_WORKLOADS),
        help=f"comma-separated, of {', '.join(DASHES)}",
    )  # fmt: skip
    p.add_argument(
        "--modes",
        default=",".join(MODES),
        help="comma-separated, of off (always run), policy, fixed k",
    )
    p.add_argument("--tokens", type=int, default=64, help="output tokens per request")
    p.add_argument(
        "--repeats", type=int, default=2,
        help="rounds per point (each mode's fastest is kept, and the median of its speedups)",
    )  # fmt: skip
    p.add_argument("--plot", default=None, help="write the SVG plot here")
    p.add_argument("--save-result", default=None)
    p.set_defaults(func=cmd_spec_sweep)


def cmd_spec_sweep(args: argparse.Namespace) -> int:
    workloads, modes = named_choices(args.workloads, DASHES), named_choices(args.modes, MODES)
    modes = ("off",) + tuple(m for m in modes if m != "off")
    if len(modes) == 1:
        raise SystemExit("--modes: off is always run; name policy, fixed k or both beside it")
    fields = {"speculative": args.speculative, "draft_model": args.draft_model,
              "num_speculative_tokens": args.num_speculative_tokens}  # fmt: skip
    if args.draft_prompt_lookup is not None:
        fields["draft_prompt_lookup"] = args.draft_prompt_lookup
    if args.model:
        fields["model"] = args.model
    engine = Engine(EngineConfig(**fields))
    concurrencies = [int(c) for c in args.concurrency.split(",")]
    k = engine.config.num_speculative_tokens
    points = sweep(engine, concurrencies, args.tokens, k, args.repeats, workloads, modes)
    print(table(points))
    if args.plot:
        model = args.model or DEFAULT_MODEL
        title = f"{args.speculative} on {model}: speedup over no speculation"
        Path(args.plot).write_text(svg_plot(points, title))
    save_result(args.save_result, {"bench": "spec-sweep", "points": points})
    print(json.dumps({"points": len(points)}))
    return 0


def named_choices(listed: str, known) -> tuple[str, ...]:
    chosen = tuple(name.strip() for name in listed.split(",") if name.strip())
    unknown = [name for name in chosen if name not in known]
    if unknown or not chosen:
        raise SystemExit(
            f"unknown {', '.join(unknown) or 'empty list'}: choose from {', '.join(known)}"
        )
    return chosen
