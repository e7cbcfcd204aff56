"""`conveyor bench spec-sweep`: speculative decoding from concurrency 1 to saturation, the goodput
policy against fixed k (the rule other engines use) and against no speculation, on two workloads:
"copy" (reproduce a given source file: much to copy) and "chat" (a story: little to copy).

One engine in one process runs every point: for each workload and concurrency C, C copies of the
workload's prompt run together (`Engine.generate`, greedy, `ignore_eos`), in three modes back to
back, --repeats rounds, the fastest of each kept: off (the scheduler's drafter removed), the
policy (the engine's own), fixed k (every row that may speculate gets --num-speculative-tokens
drafts). The prompt's prefix is cached first (the draft model's too), so that no mode pays its
prefill alone. Reports output tok/s, the speedup over off, the acceptance rate and the k the
policy chose, as a table and an SVG plot.

    conveyor bench spec-sweep --speculative ngram --concurrency 1,4,16 --plot docs/images/spec-sweep.svg
"""

from __future__ import annotations

import argparse
import json
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
DASHES = {"copy": "", "json": "2,3", "chat": "6,4"}


def prompts() -> dict[str, str]:
    source = COPY_SOURCE.read_text().rstrip("\n")
    document = JSON_SOURCE.read_text().rstrip("\n")
    return {
        "copy": f"Output the following Python code exactly, unchanged:\n\n{source}",
        "json": f"Here is a JSON document:\n\n{document}\n\nOutput the same JSON document with one "
        'change: the price of "fig" is 9.99. Output only the JSON.',
        "chat": "Write a short story about a lighthouse keeper who finds a message in a bottle.",
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
    engine: Engine, concurrencies: list[int], tokens: int, k: int, repeats: int
) -> list[dict]:
    """Each point: the modes in turn, `repeats` rounds; each mode's fastest round is kept (the
    machine's noise only slows a run down). The prompt's prefix is cached before the first."""
    policy, drafter = engine.speculator.policy, engine.scheduler.drafter
    points = []
    for workload, text in prompts().items():
        ids = engine.tokenizer.apply_chat_template([{"role": "user", "content": text}])
        warm_caches(engine, ids, k)
        for concurrency in concurrencies:
            point = {"workload": workload, "concurrency": concurrency}
            for _ in range(repeats):
                for mode in MODES:
                    engine.scheduler.drafter = None if mode == "off" else drafter
                    engine.speculator.policy = FixedK(k) if mode == "fixed k" else policy
                    measured = run_point(engine, ids, concurrency, tokens)
                    if mode not in point or measured["tok_s"] > point[mode]["tok_s"]:
                        point[mode] = measured
            engine.scheduler.drafter, engine.speculator.policy = drafter, policy
            points.append(point)
    return points


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
    rows = []
    for p in points:
        off = p["off"]["tok_s"]
        cells = [p["workload"], p["concurrency"], f"{off:.1f}"]
        for mode in MODES[1:]:
            r = p[mode]
            acceptance = "" if r["acceptance"] is None else f", {r['acceptance']:.2f}"
            cells.append(f"{r['tok_s']:.1f} ({r['tok_s'] / off:.2f}x{acceptance})")
        cells.append(", ".join(f"{k}: {n}" for k, n in p["policy"]["k_rows"].items()))
        rows.append(cells)
    header = ["workload", "C", "off tok/s", "policy (speedup, acceptance)", "fixed k", "k chosen"]
    return format_table(header, rows)


def svg_plot(points: list[dict], title: str) -> str:
    """Speedup over off against concurrency (log scale): a line per workload and mode."""
    width, height, left, right, top, bottom = 640, 380, 60, 150, 40, 50
    concurrencies = sorted({p["concurrency"] for p in points})
    speedups = [p[m]["tok_s"] / p["off"]["tok_s"] for p in points for m in MODES[1:]]
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
        for mode in MODES[1:]:
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
    p.add_argument("--tokens", type=int, default=64, help="output tokens per request")
    p.add_argument("--repeats", type=int, default=2, help="rounds per point (the best is kept)")
    p.add_argument("--plot", default=None, help="write the SVG plot here")
    p.add_argument("--save-result", default=None)
    p.set_defaults(func=cmd_spec_sweep)


def cmd_spec_sweep(args: argparse.Namespace) -> int:
    fields = {"speculative": args.speculative, "draft_model": args.draft_model,
              "num_speculative_tokens": args.num_speculative_tokens}  # fmt: skip
    if args.draft_prompt_lookup is not None:
        fields["draft_prompt_lookup"] = args.draft_prompt_lookup
    if args.model:
        fields["model"] = args.model
    engine = Engine(EngineConfig(**fields))
    concurrencies = [int(c) for c in args.concurrency.split(",")]
    k = engine.config.num_speculative_tokens
    points = sweep(engine, concurrencies, args.tokens, k, args.repeats)
    print(table(points))
    if args.plot:
        model = args.model or DEFAULT_MODEL
        title = f"{args.speculative} on {model}: speedup over no speculation"
        Path(args.plot).write_text(svg_plot(points, title))
    save_result(args.save_result, {"bench": "spec-sweep", "points": points})
    print(json.dumps({"points": len(points)}))
    return 0
