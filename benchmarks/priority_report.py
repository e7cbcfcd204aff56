"""The tables `conveyor bench priority` prints."""

from __future__ import annotations

from benchmarks.common import format_table


def print_priority_report(result: dict) -> None:
    idle = result["idle"]
    print(f"model {result['model']}, {result['dtype']}, {result['torch_threads']} threads")
    print(
        f"idle: interactive TTFT p50 {ms(idle['ttft']['p50_s'])} p99 {ms(idle['ttft']['p99_s'])}, "
        f"median step {ms(idle['median_step_s'])}"
    )
    alone = result["batch_alone"]
    print(
        f"batch alone: {alone['batch_tokens_per_s']:.1f} output tok/s, "
        f"median step {ms(alone['median_step_s'])}"
    )
    print(format_table(*loaded_table(result["loaded"])))
    print(format_table(*fairness_table(result["fairness"])))


def loaded_table(loaded: dict) -> tuple[list[str], list[list]]:
    header = [
        "mode", "TTFT p50", "TTFT p99", "p99 bound", "met", "batch tok/s", "batch loss",
        "interactive tok/s",
        "preempt swap", "preempt recomp", "swapped s", "recomp wait s", "swap copy s",
        "recomp tokens", "median step",
    ]  # fmt: skip
    rows = [
        [
            mode,
            ms(p["ttft"]["p50_s"]),
            ms(p["ttft"]["p99_s"]),
            ms(p["ttft_target"]["bound_s"]),
            p["ttft_target"]["met"],
            p["batch_tokens_per_s"],
            percent(p["batch_throughput_loss"]),
            p["interactive_tokens_per_s"],
            p["preemptions"]["swap"],
            p["preemptions"]["recompute"],
            p["preempted_time"]["swap"]["total_s"],
            p["preempted_time"]["recompute"]["total_s"],
            p["swap_copy_seconds"],
            p["recompute"]["tokens"],
            ms(p["median_step_s"]),
        ]
        for mode, p in loaded.items()
    ]
    return header, rows


def fairness_table(fairness: dict) -> tuple[list[str], list[list]]:
    header = ["pair", "weights", "window s", "served tokens", "ratio", "target", "within 10%"]
    rows = [
        [
            name,
            "/".join(f"{w:g}" for w in f["weights"].values()),
            f["window_s"],
            " / ".join(f"{v:.0f}" for v in f["served_tokens"].values()),
            f["served_ratio"],
            f["target_ratio"],
            f["within_10_percent"],
        ]
        for name, f in fairness.items()
    ]
    return header, rows


def ms(seconds: float | None) -> str:
    return "-" if seconds is None else f"{1e3 * seconds:.0f} ms"


def percent(value: float | None) -> str:
    return "-" if value is None else f"{100 * value:.1f}%"
