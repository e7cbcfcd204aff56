"""`conveyor bench offline`: one workload, one model, one dtype, one machine, five ways:

  1. Conveyor continuous batching (the engine's default scheduler)
  2. Conveyor static batching (`scheduling="static"`, same loaded engine, fresh scheduler), then
     dynamic batching (`scheduling="dynamic"`: a batch forms at max-num-seqs requests or after
     --batch-window, then runs to completion)
  3. transformers `generate` in static batches with exactly Conveyor static's batch membership
     (left padding; each batch runs to its longest request; only asked-for tokens count)
  4. transformers continuous batching (`continuous_batching_context_manager`, per-request
     max_new_tokens, KV cache of the same size as Conveyor's)

plus the fraction of the compute roofline and the KV-cache waste at peak.
"""

from __future__ import annotations

import argparse
import platform
import statistics
import time

import torch

from benchmarks.bound import DeviceRates, ModelCosts, StepBound, best_rates
from benchmarks.common import (
    build_engine,
    format_table,
    progress,
    ratio,
)
from benchmarks.peers import (
    PeerUnavailable,
    load_transformers_model,
    run_transformers_continuous,
    run_transformers_static,
)
from benchmarks.workload import (
    SystemRun,
    Workload,
    benchmark_params,
    file_workload,
    synthetic_workload,
)

TARGETS = {
    "vs_transformers_static": 5.0,
    "vs_transformers_generate_batch": 3.0,
    "roofline_fraction": 0.25,
    "physical_bound_share": 0.6,  # the GPU target (H100, 8B shape)
    "kv_waste_at_peak": 0.04,
}


# ---- KV-cache waste -------------------------------------------------------------------------
class KVWasteTracker:
    """After each step: allocated GPU slots (blocks with a reference x block size) against slots
    holding computed KV. Waste is reported at the step of peak allocation, and on average."""

    def __init__(self, block_manager) -> None:
        self.block_manager = block_manager
        self.peak_blocks = 0
        self.waste_at_peak = 0.0
        self.total_allocated_slots = 0
        self.total_unused_slots = 0
        self.seconds = 0.0  # time spent observing, taken out of the measured run

    def observe(self, running) -> None:
        start = time.perf_counter()
        bm = self.block_manager
        allocated_blocks = bm.num_gpu_blocks - bm.num_free_gpu_blocks
        allocated_slots = allocated_blocks * bm.block_size
        unused = allocated_slots - self._used_slots(running, bm.block_size)
        self.total_allocated_slots += allocated_slots
        self.total_unused_slots += unused
        if allocated_blocks > self.peak_blocks:
            self.peak_blocks = allocated_blocks
            self.waste_at_peak = unused / allocated_slots
        self.seconds += time.perf_counter() - start

    @staticmethod
    def _used_slots(running, block_size: int) -> int:
        """Slots with computed KV, each shared (prefix-cached) block counted once."""
        fill: dict[int, int] = {}
        for request in running:
            num_computed = request.num_computed_tokens
            for i, block_id in enumerate(request.block_ids):
                filled = min(block_size, max(0, num_computed - i * block_size))
                fill[block_id] = max(fill.get(block_id, 0), filled)
        return sum(fill.values())

    def summary(self) -> dict:
        return {
            "peak_allocated_blocks": self.peak_blocks,
            "num_gpu_blocks": self.block_manager.num_gpu_blocks,
            "block_size": self.block_manager.block_size,
            "waste_at_peak": self.waste_at_peak,
            "mean_waste": self.total_unused_slots / max(self.total_allocated_slots, 1),
        }


# ---- Conveyor -------------------------------------------------------------------------------
def run_conveyor(engine, workload: Workload, policy: str) -> tuple[SystemRun, list, KVWasteTracker]:
    engine.reset_scheduler(policy=policy)
    if engine.speculator is not None:
        engine.speculator.reset_stats()
    tracker = KVWasteTracker(engine.block_manager)
    step_seconds = []
    start = time.perf_counter()
    requests = [
        engine.add_request(prompt, benchmark_params(n), request_id=f"{policy}-{i}")
        for i, (prompt, n) in enumerate(zip(workload.prompts, workload.output_lens))
    ]
    runner = engine.runner
    costs = ModelCosts.of(runner.model_config, runner.dtype, runner.model.weight_bytes_per_token())
    bound = StepBound(costs, requests)
    while engine.has_unfinished():
        time.sleep(engine.seconds_until_runnable())  # dynamic batching waits for its batch
        step_start = time.perf_counter()
        engine.step()
        step_seconds.append(time.perf_counter() - step_start)
        tracker.observe(engine.scheduler.running)
        bound.observe_step()
    seconds = time.perf_counter() - start - tracker.seconds - bound.bookkeeping_s
    output_tokens = sum(r.num_output_tokens for r in requests)
    assert output_tokens == sum(workload.output_lens), "a request stopped early"
    details = {
        "num_steps": len(step_seconds),
        "mean_step_ms": 1e3 * sum(step_seconds) / max(len(step_seconds), 1),
        "tokens_per_step": (sum(workload.output_lens) + sum(map(len, workload.prompts)))
        / max(len(step_seconds), 1),
        "num_preemptions": dict(engine.scheduler.num_preemptions),
    }
    if engine.speculator is not None:
        details["spec_decode"] = engine.speculator.summary()
    run = SystemRun(f"conveyor_{policy}", seconds, output_tokens, details, bound)
    return run, requests, tracker


def static_batches(requests) -> list[list[int]]:
    """Indices of the requests that Conveyor static admitted together (same first schedule)."""
    groups: dict[float, list[int]] = {}
    for index, request in enumerate(requests):
        groups.setdefault(request.first_scheduled_time, []).append(index)
    return [groups[t] for t in sorted(groups)]


# ---- the benchmark --------------------------------------------------------------------------
def run_offline_bench(args: argparse.Namespace) -> dict:
    engine = build_engine(args)
    vocab_size = engine.runner.model_config.vocab_size
    workload = (
        file_workload(engine, args.input) if args.input else synthetic_workload(args, vocab_size)
    )
    progress(f"workload: {workload.summary()}")
    rates = [sample_rates(engine)]
    runs, kv = run_conveyor_systems(engine, workload)
    rates.append(sample_rates(engine))
    rounds, unavailable = [], {}
    if not args.skip_transformers:
        model = load_transformers_model(
            engine.source.path, engine.runner.dtype, engine.runner.device
        )
        batches = runs[1].details["batches"]
        runs += run_transformers_systems(model, engine, workload, batches, unavailable)
        rates.append(sample_rates(engine))
        by_name = {run.name: run for run in runs}
        if "transformers_generate_batch" in by_name:
            first = (by_name["conveyor_continuous"], by_name["transformers_generate_batch"])
            rounds = run_paired_rounds(engine, model, workload, first, args.rounds)
    result = build_result(args, engine, workload, runs, kv, rates, rounds)
    result["unavailable"] = unavailable
    return result


def run_paired_rounds(engine, model, workload: Workload, first, num_rounds: int) -> list[dict]:
    """Conveyor continuous against generate_batch again, back to back, alternating which goes
    first: on a shared machine the ratio within a pair is what holds still, not the rates."""
    pairs = [first]
    for number in range(1, num_rounds):
        progress(f"round {number + 1}/{num_rounds}: conveyor continuous and generate_batch ...")
        if number % 2:
            hf = run_transformers_continuous(model, workload, engine)
            conveyor = run_conveyor(engine, workload, engine.config.scheduling)[0]
        else:
            conveyor = run_conveyor(engine, workload, engine.config.scheduling)[0]
            hf = run_transformers_continuous(model, workload, engine)
        progress(f"  {conveyor.output_tokens_per_s:.1f} vs {hf.output_tokens_per_s:.1f} tok/s")
        pairs.append((conveyor, hf))
    return [
        {
            "conveyor_continuous": conveyor.output_tokens_per_s,
            "transformers_generate_batch": hf.output_tokens_per_s,
            "ratio": conveyor.output_tokens_per_s / hf.output_tokens_per_s,
        }
        for conveyor, hf in pairs
    ]


def sample_rates(engine) -> DeviceRates:
    """Copy bandwidth and matmul rate on the engine's device, sampled before, between and after
    the runs (the bound uses the best of each)."""
    rates = DeviceRates.measure(engine.runner.device, engine.runner.dtype)
    progress(
        f"device rates: copy {rates.copy_bytes_per_s / 1e9:.0f} GB/s, "
        f"matmul {rates.matmul_flops_per_s / 1e9:.0f} GFLOP/s in {engine.runner.dtype}"
    )
    return rates


def run_conveyor_systems(engine, workload: Workload) -> tuple[list[SystemRun], KVWasteTracker]:
    progress("conveyor continuous ...")
    continuous, _, kv = run_conveyor(engine, workload, engine.config.scheduling)
    continuous.name = "conveyor_continuous"
    progress(f"  {continuous.output_tokens_per_s:.1f} output tok/s")
    progress("conveyor static ...")
    static, requests, _ = run_conveyor(engine, workload, "static")
    static.details["batches"] = static_batches(requests)
    static.details["batch_sizes"] = [len(b) for b in static.details["batches"]]
    progress(f"  {static.output_tokens_per_s:.1f} output tok/s")
    progress("conveyor dynamic ...")
    dynamic, requests, _ = run_conveyor(engine, workload, "dynamic")
    dynamic.details["batch_sizes"] = [len(b) for b in static_batches(requests)]
    progress(f"  {dynamic.output_tokens_per_s:.1f} output tok/s")
    engine.reset_scheduler(policy=engine.config.scheduling)
    return [continuous, static, dynamic], kv


def run_transformers_systems(
    model, engine, workload: Workload, batches, unavailable: dict[str, str]
) -> list[SystemRun]:
    progress("transformers generate, static batches ...")
    static = run_transformers_static(model, workload, batches)
    progress(f"  {static.output_tokens_per_s:.1f} output tok/s")
    progress("transformers generate_batch (continuous) ...")
    try:
        continuous = run_transformers_continuous(model, workload, engine)
    except PeerUnavailable as error:
        progress(f"  cannot run here: {error}")
        unavailable["transformers_generate_batch"] = str(error)
        return [static]
    progress(f"  {continuous.output_tokens_per_s:.1f} output tok/s")
    return [static, continuous]


def build_result(
    args, engine, workload, runs, kv: KVWasteTracker, rate_samples, rounds: list[dict]
) -> dict:
    rates = best_rates(rate_samples)
    matmul_flops = rates.matmul_flops_per_s
    by_name = {run.name: run for run in runs}
    conveyor = by_name["conveyor_continuous"].output_tokens_per_s
    flops_per_token = 2 * engine.runner.model_config.num_parameters
    all_tokens = workload.summary()["prompt_tokens"] + workload.summary()["output_tokens"]
    all_tokens_per_s = all_tokens / by_name["conveyor_continuous"].seconds
    for run in runs:
        run.details.pop("batches", None)
    result = {
        "command": "conveyor bench offline",
        "args": {k: v for k, v in vars(args).items() if k != "func"},
        "machine": machine_facts(engine),
        "workload": workload.summary(),
        "systems": {run.name: system_entry(run, conveyor, rates) for run in runs},
        "physical_bound": by_name["conveyor_continuous"].bound.summary(
            rates, by_name["conveyor_continuous"].seconds
        ),
        "roofline": {
            "num_parameters": engine.runner.model_config.num_parameters,
            "flops_per_output_token": flops_per_token,
            "matmul_flops_per_s": matmul_flops,
            "matmul_flops_per_s_samples": [r.matmul_flops_per_s for r in rate_samples],
            "roofline_output_tokens_per_s": matmul_flops / flops_per_token,
            "fraction": conveyor * flops_per_token / matmul_flops,
            "fraction_counting_prompt_tokens": all_tokens_per_s * flops_per_token / matmul_flops,
        },
        "kv_cache": kv.summary(),
        "paired_rounds": rounds,
    }
    result["targets"] = check_targets(result)
    return result


def system_entry(run: SystemRun, conveyor_tokens_per_s: float, rates: DeviceRates) -> dict:
    entry = {
        "seconds": run.seconds,
        "output_tokens": run.output_tokens,
        "output_tokens_per_s": run.output_tokens_per_s,
        "conveyor_continuous_speedup": ratio(conveyor_tokens_per_s, run.output_tokens_per_s),
        **run.details,
    }
    if run.bound is not None:
        entry["physical_bound_share"] = run.bound.seconds(rates) / run.seconds
    return entry


def machine_facts(engine) -> dict:
    return {
        "platform": platform.platform(),
        "processor": platform.processor() or platform.machine(),
        "torch": torch.__version__,
        "torch_threads": torch.get_num_threads(),
        "device": str(engine.runner.device),
        "dtype": str(engine.runner.dtype).removeprefix("torch."),
        "quantization": engine.config.quantization,
        "weight_bytes_per_token": engine.runner.model.weight_bytes_per_token(),
        "model": engine.model_name,
    }


def check_targets(result: dict) -> dict:
    systems = result["systems"]

    def speedup(name: str) -> float | None:
        return systems[name]["conveyor_continuous_speedup"] if name in systems else None

    rounds = [entry["ratio"] for entry in result["paired_rounds"]]
    measured = {
        "vs_transformers_static": speedup("transformers_static"),
        "vs_transformers_generate_batch": statistics.median(rounds) if rounds else None,
        "roofline_fraction": result["roofline"]["fraction"],
        "physical_bound_share": result["physical_bound"]["share"],
        "kv_waste_at_peak": result["kv_cache"]["waste_at_peak"],
    }
    met = {
        name: None
        if value is None
        else (value < TARGETS[name] if name == "kv_waste_at_peak" else value >= TARGETS[name])
        for name, value in measured.items()
    }
    return {"target": TARGETS, "measured": measured, "met": met}


def print_offline_report(result: dict) -> None:
    rows = [
        [
            name,
            s["seconds"],
            s["output_tokens"],
            s["output_tokens_per_s"],
            s["conveyor_continuous_speedup"],
        ]
        for name, s in result["systems"].items()
    ]
    header = ["system", "seconds", "output tokens", "output tok/s", "conveyor continuous x"]
    machine, roof, kv = result["machine"], result["roofline"], result["kv_cache"]
    print(f"model {machine['model']}, {machine['dtype']}, {machine['torch_threads']} threads")
    print(f"workload: {result['workload']}")
    print(format_table(header, rows))
    print(
        f"roofline: {roof['matmul_flops_per_s'] / 1e9:.0f} GFLOP/s matmul, "
        f"{roof['flops_per_output_token'] / 1e6:.0f} MFLOP/token -> "
        f"{roof['roofline_output_tokens_per_s']:.0f} output tok/s; Conveyor reaches "
        f"{100 * roof['fraction']:.1f}% ({100 * roof['fraction_counting_prompt_tokens']:.1f}% "
        "counting prompt tokens too)"
    )
    bound = result["physical_bound"]
    print(
        f"physical bound: {bound['bound_seconds']:.2f} s over {bound['num_steps']} steps "
        f"(copy {bound['copy_bytes_per_s'] / 1e9:.0f} GB/s, matmul "
        f"{bound['matmul_flops_per_s'] / 1e9:.0f} GFLOP/s); Conveyor continuous took "
        f"{bound['measured_seconds']:.2f} s = {100 * bound['share']:.1f}% of the hardware's speed"
    )
    print(
        f"KV cache: waste at peak {100 * kv['waste_at_peak']:.2f}% "
        f"({kv['peak_allocated_blocks']} of {kv['num_gpu_blocks']} blocks), "
        f"mean {100 * kv['mean_waste']:.2f}%"
    )
    for name, system in result["systems"].items():
        if "spec_decode" in system:
            print(spec_decode_line(name, system["spec_decode"]))
    for name, reason in result.get("unavailable", {}).items():
        print(f"{name}: cannot run here: {reason}")
    for number, entry in enumerate(result["paired_rounds"], start=1):
        print(
            f"round {number}: conveyor continuous {entry['conveyor_continuous']:.1f} vs "
            f"generate_batch {entry['transformers_generate_batch']:.1f} tok/s = "
            f"{entry['ratio']:.2f}x"
        )
    targets = result["targets"]
    for name, met in targets["met"].items():
        value = targets["measured"][name]
        shown = "-" if value is None else f"{value:.3g}"
        verdict = "" if met is None else ("met" if met else "MISSED")
        print(f"target {name}: {TARGETS[name]}, measured {shown} {verdict}")


def spec_decode_line(name: str, spec: dict) -> str:
    ks = ", ".join(f"k={k}: {n}" for k, n in spec["num_rows_per_k"].items())
    return (
        f"{name} speculation: acceptance {100 * spec['acceptance_rate']:.1f}%, mean accepted "
        f"length {spec['mean_accepted_length']:.2f} over {spec['num_drafts']} drafted rows; "
        f"k chosen per decode row: {ks or 'none'}"
    )
