"""`conveyor bench priority`: what priorities, preemption and fair share buy, measured by driving
`Engine.step()` directly and submitting each request when its arrival time comes.

Phases, all on one loaded model (each with a fresh scheduler and an empty KV cache):
  idle          interactive priority-0 requests arrive at intervals on an empty engine
  batch alone   tenant "batch" (low priority) saturates the engine; its output rate over a window
  loaded/<mode> the same batch load, then the same interactive arrivals once the engine is
                saturated; once per preemption mode (auto, swap, recompute)
  fairness      two equal-weight tenants with equal demand, then a 2:1 weight pair, measured
                while both still have requests waiting

TTFT counts from a request's intended arrival time, so a request that arrives while a step
runs waits for that step, as it would in a server.
"""

from __future__ import annotations

import argparse
import random
import time
from collections.abc import Callable
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch

from benchmarks.common import (
    abort_all,
    build_engine,
    percentile,
    progress,
    random_prompt,
    ratio,
)
from scheduler import events as ev
from scheduler.request import SamplingParams

BATCH, INTERACTIVE = "batch", "interactive"
FAIRNESS_TOLERANCE = 0.10


@dataclass
class Arrival:
    request_id: str
    at: float  # seconds after the phase's trigger
    prompt: list[int]
    max_tokens: int
    tenant: str
    priority: int = 0
    weight: float = 1.0


@dataclass
class Trace:
    """What happened in one phase, in perf_counter seconds."""

    start: float = 0.0
    trigger_time: float | None = None
    end: float = 0.0
    arrival_time: dict[str, float] = field(default_factory=dict)  # intended, absolute
    requests: dict = field(default_factory=dict)  # request_id -> Request
    tenant_of: dict[str, str] = field(default_factory=dict)
    first_token_time: dict[str, float] = field(default_factory=dict)
    finish_time: dict[str, float] = field(default_factory=dict)
    emitted: list[tuple[float, str, int]] = field(default_factory=list)  # (time, tenant, tokens)
    step_seconds: list[float] = field(default_factory=list)

    def tokens_between(self, tenant: str, begin: float, end: float) -> int:
        return sum(n for t, who, n in self.emitted if who == tenant and begin <= t <= end)

    def ttfts(self, tenant: str) -> list[float]:
        return [
            self.first_token_time[rid] - self.arrival_time[rid]
            for rid, who in self.tenant_of.items()
            if who == tenant and rid in self.first_token_time
        ]


# ---- driving the engine ---------------------------------------------------------------------
def drive(
    engine,
    immediate: list[Arrival],
    delayed: list[Arrival] = (),
    trigger: Callable | None = None,
    stop: Callable | None = None,
) -> Trace:
    """Submit `immediate` now and each of `delayed` at its `at` seconds after `trigger(engine)`
    first holds (at once without a trigger); step until `stop(engine, trace, now)` or nothing is
    left to do."""
    trace = Trace(start=time.perf_counter())
    for arrival in immediate:
        submit(engine, trace, arrival, trace.start)
    pending = sorted(delayed, key=lambda a: a.at)
    if trigger is None:
        trace.trigger_time = trace.start
    while True:
        now = time.perf_counter()
        if trace.trigger_time is None and trigger(engine):
            trace.trigger_time = now
        while pending and is_due(pending[0], trace, now):
            arrival = pending.pop(0)
            submit(engine, trace, arrival, trace.trigger_time + arrival.at)
        if stop is not None and stop(engine, trace, now):
            break
        if not engine.has_unfinished():
            if not pending:
                break
            time.sleep(0.001)
            continue
        run_step(engine, trace)
    trace.end = time.perf_counter()
    return trace


def is_due(arrival: Arrival, trace: Trace, now: float) -> bool:
    return trace.trigger_time is not None and trace.trigger_time + arrival.at <= now


def submit(engine, trace: Trace, arrival: Arrival, intended_time: float) -> None:
    params = SamplingParams(max_tokens=arrival.max_tokens, temperature=0.0, ignore_eos=True)
    request = engine.add_request(
        arrival.prompt,
        params,
        request_id=arrival.request_id,
        priority=arrival.priority,
        tenant=arrival.tenant,
        weight=arrival.weight,
    )
    trace.requests[arrival.request_id] = request
    trace.tenant_of[arrival.request_id] = arrival.tenant
    trace.arrival_time[arrival.request_id] = intended_time


def run_step(engine, trace: Trace) -> None:
    step_start = time.perf_counter()
    outputs = engine.step()
    now = time.perf_counter()
    trace.step_seconds.append(now - step_start)
    for output in outputs:
        rid = output.request_id
        if output.new_token_ids:
            trace.emitted.append((now, trace.tenant_of[rid], len(output.new_token_ids)))
            trace.first_token_time.setdefault(rid, now)
        if output.finished:
            trace.finish_time[rid] = now


def end_phase(engine) -> None:
    abort_all(engine)
    engine.reset_scheduler()


# ---- workloads ------------------------------------------------------------------------------
def batch_arrivals(args, rng: random.Random, vocab_size: int) -> list[Arrival]:
    return [
        Arrival(
            f"batch-{i}",
            0.0,
            random_prompt(rng, args.batch_prompt_len, vocab_size),
            args.batch_output_len,
            BATCH,
            priority=args.batch_priority,
        )
        for i in range(args.num_batch_requests)
    ]


def interactive_arrivals(args, rng: random.Random, vocab_size: int) -> list[Arrival]:
    return [
        Arrival(
            f"interactive-{i}",
            i * args.interactive_interval,
            random_prompt(rng, args.interactive_prompt_len, vocab_size),
            args.interactive_output_len,
            INTERACTIVE,
            priority=0,
        )
        for i in range(args.num_interactive)
    ]


def with_ids(arrivals: list[Arrival], suffix: str) -> list[Arrival]:
    """The same requests under fresh ids (each phase's engine sees new requests)."""
    return [
        Arrival(
            f"{a.request_id}-{suffix}", a.at, a.prompt, a.max_tokens, a.tenant, a.priority, a.weight
        )
        for a in arrivals
    ]


def is_saturated(engine) -> bool:
    """Every running slot taken (or every request admitted) and no prompt still prefilling."""
    scheduler = engine.scheduler
    running = scheduler.running
    full = len(running) >= scheduler.config.max_num_seqs or not scheduler.waiting
    return bool(running) and full and all(r.num_output_tokens > 0 for r in running)


# ---- phases ---------------------------------------------------------------------------------
def run_idle_phase(engine, interactive: list[Arrival]) -> dict:
    trace = drive(engine, [], with_ids(interactive, "idle"))
    end_phase(engine)
    return {"ttft": latency_summary(trace.ttfts(INTERACTIVE)), **step_summary(trace)}


def run_batch_alone_phase(engine, batch: list[Arrival], window: float) -> dict:
    def stop(engine, trace, now):
        return trace.trigger_time is not None and now >= trace.trigger_time + window

    trace = drive(engine, with_ids(batch, "alone"), trigger=is_saturated, stop=stop)
    end_phase(engine)
    return {
        "batch_tokens_per_s": batch_rate(trace),
        "window_s": window_seconds(trace),
        **step_summary(trace),
    }


def run_loaded_phase(engine, batch, interactive, window: float, mode: str) -> dict:
    engine.reset_scheduler(preemption_mode=mode)
    interactive = with_ids(interactive, mode)
    interactive_ids = {a.request_id for a in interactive}

    def stop(engine, trace, now):
        window_over = trace.trigger_time is not None and now >= trace.trigger_time + window
        return window_over and interactive_ids <= trace.finish_time.keys()

    with timed_swaps(engine.runner.kv_cache) as swap_seconds:
        trace = drive(engine, with_ids(batch, mode), interactive, trigger=is_saturated, stop=stop)
    preemptions = dict(engine.scheduler.num_preemptions)
    end_phase(engine)
    return {
        "preemption_mode": mode,
        "ttft": latency_summary(trace.ttfts(INTERACTIVE)),
        "batch_tokens_per_s": batch_rate(trace),
        "interactive_tokens_per_s": batch_rate(trace, INTERACTIVE),
        "window_s": window_seconds(trace),
        "preemptions": preemptions,
        "preempted_time": preempted_intervals(trace),
        "swap_copy_seconds": swap_seconds["seconds"],
        "recompute": recompute_summary(trace, engine.scheduler.cost_model),
        **step_summary(trace),
    }


def run_fairness_phase(engine, args, rng, weights: tuple[float, float]) -> dict:
    vocab_size = engine.runner.model_config.vocab_size
    tenants = ("tenant-a", "tenant-b")
    lens_a = fairness_output_lens(args, rng)
    lens_b = rng.sample(lens_a, len(lens_a))  # equal demand, in another order
    arrivals = [
        Arrival(
            f"fair-{weights[0]}-{weights[1]}-{tenant}-{i}",
            0.0,
            random_prompt(rng, args.fairness_prompt_len, vocab_size),
            output_len,
            tenant,
            weight=weight,
        )
        for i, pair in enumerate(zip(lens_a, lens_b))
        for tenant, weight, output_len in zip(tenants, weights, pair)  # interleaved arrivals
    ]
    trace = drive(engine, arrivals, stop=lambda e, t, now: not both_backlogged(e, tenants))
    served = {t: engine.scheduler.order.tenant_service[t] * w for t, w in zip(tenants, weights)}
    end_phase(engine)
    return fairness_summary(trace, tenants, weights, served)


def fairness_output_lens(args, rng: random.Random) -> list[int]:
    """Varied lengths, so that slots free up one by one rather than in lockstep waves."""
    mean = args.fairness_output_len
    low, high = max(1, mean // 2), max(1, mean * 3 // 2)
    return [rng.randint(low, high) for _ in range(args.num_fairness_requests)]


def both_backlogged(engine, tenants) -> bool:
    waiting = {r.tenant for r in engine.scheduler.waiting}
    return all(t in waiting for t in tenants)


# ---- measurements ---------------------------------------------------------------------------
@contextmanager
def timed_swaps(kv_cache):
    """Time the real KV block copies of swap-out and swap-in during the block."""
    totals = {"seconds": 0.0}
    originals = {"swap_out": kv_cache.swap_out, "swap_in": kv_cache.swap_in}

    def timed(original):
        def copy(mapping):
            start = time.perf_counter()
            original(mapping)
            totals["seconds"] += time.perf_counter() - start

        return copy

    for name, original in originals.items():
        setattr(kv_cache, name, timed(original))
    try:
        yield totals
    finally:
        for name in originals:
            delattr(kv_cache, name)  # back to the class's methods


def preempted_intervals(trace: Trace) -> dict:
    """Seconds from `preempted` to `resumed` per mode (still preempted at the phase's end:
    until its `aborted`)."""
    seconds = {"swap": [], "recompute": []}
    for request in trace.requests.values():
        started = None
        for event in request.events:
            if event.kind == ev.PREEMPTED:
                started = (event.time, event.data["mode"])
            elif event.kind in (ev.RESUMED, ev.ABORTED) and started is not None:
                seconds[started[1]].append(event.time - started[0])
                started = None
    return {
        mode: {"count": len(v), "total_s": sum(v), "mean_s": sum(v) / len(v) if v else None}
        for mode, v in seconds.items()
    }


def recompute_summary(trace: Trace, cost_model) -> dict:
    tokens = 0
    for request in trace.requests.values():
        for event in request.events:
            if event.kind == ev.RECOMPUTE_STARTED:
                tokens += event.data["num_tokens"] - event.data["num_cached_tokens"]
    return {
        "tokens": tokens,
        "estimated_seconds": tokens / cost_model.prefill_tokens_per_s,
    }


def window_seconds(trace: Trace) -> float | None:
    """From saturation (the trigger) to the end of the phase."""
    if trace.trigger_time is None or trace.end <= trace.trigger_time:
        return None
    return trace.end - trace.trigger_time


def batch_rate(trace: Trace, tenant: str = BATCH) -> float | None:
    """A tenant's output tokens/s over the window from saturation to the end of the phase."""
    window = window_seconds(trace)
    if window is None:
        return None
    return trace.tokens_between(tenant, trace.trigger_time, trace.end) / window


def latency_summary(values: list[float]) -> dict:
    return {
        "count": len(values),
        "p50_s": percentile(values, 50),
        "p99_s": percentile(values, 99),
        "max_s": max(values, default=None),
    }


def step_summary(trace: Trace) -> dict:
    return {
        "num_steps": len(trace.step_seconds),
        "median_step_s": percentile(trace.step_seconds, 50),
        "p99_step_s": percentile(trace.step_seconds, 99),
    }


def fairness_summary(trace: Trace, tenants, weights, served: dict) -> dict:
    a, b = tenants
    target = weights[0] / weights[1]
    measured = ratio(served[a], served[b])
    window = trace.end - trace.start
    return {
        "weights": dict(zip(tenants, weights)),
        "window_s": window,
        "served_tokens": served,
        "output_tokens": {t: trace.tokens_between(t, trace.start, trace.end) for t in tenants},
        "served_ratio": measured,
        "target_ratio": target,
        "within_10_percent": measured is not None
        and abs(measured - target) <= FAIRNESS_TOLERANCE * target,
    }


# ---- the benchmark --------------------------------------------------------------------------
def run_priority_bench(args: argparse.Namespace) -> dict:
    engine = build_engine(args)
    max_num_seqs = engine.scheduler.config.max_num_seqs
    args.num_batch_requests = args.num_batch_requests or 3 * max_num_seqs
    args.num_fairness_requests = args.num_fairness_requests or 2 * max_num_seqs
    rng = random.Random(args.seed)
    vocab_size = engine.runner.model_config.vocab_size
    batch = batch_arrivals(args, rng, vocab_size)
    interactive = interactive_arrivals(args, rng, vocab_size)
    window = args.num_interactive * args.interactive_interval
    progress("idle engine: interactive requests alone ...")
    idle = run_idle_phase(engine, interactive)
    progress("batch tenant alone ...")
    alone = run_batch_alone_phase(engine, batch, window)
    loaded = {}
    for mode in args.preemption_modes.split(","):
        progress(f"batch load + interactive requests, preemption mode {mode} ...")
        loaded[mode] = run_loaded_phase(engine, batch, interactive, window, mode)
    progress("fair share: equal weights, then 2:1 ...")
    fairness = {
        "equal": run_fairness_phase(engine, args, rng, (1.0, 1.0)),
        "two_to_one": run_fairness_phase(engine, args, rng, (2.0, 1.0)),
    }
    return build_result(args, engine, idle, alone, loaded, fairness)


def build_result(args, engine, idle, alone, loaded, fairness) -> dict:
    for phase in loaded.values():
        phase["batch_throughput_loss"] = throughput_loss(alone, phase)
        phase["ttft_target"] = ttft_target(idle, phase)
    return {
        "command": "conveyor bench priority",
        "args": {k: v for k, v in vars(args).items() if k != "func"},
        "model": engine.model_name,
        "dtype": str(engine.runner.dtype).removeprefix("torch."),
        "torch_threads": torch.get_num_threads(),
        "idle": idle,
        "batch_alone": alone,
        "loaded": loaded,
        "fairness": fairness,
    }


def throughput_loss(alone: dict, loaded: dict) -> float | None:
    kept = ratio(loaded["batch_tokens_per_s"], alone["batch_tokens_per_s"])
    return None if kept is None else 1.0 - kept


def ttft_target(idle: dict, loaded: dict) -> dict:
    """Interactive p99 TTFT under load <= 2 x idle p99 + two (median loaded) step times."""
    idle_p99, loaded_p99 = idle["ttft"]["p99_s"], loaded["ttft"]["p99_s"]
    if idle_p99 is None or loaded_p99 is None or loaded["median_step_s"] is None:
        return {"bound_s": None, "met": None}
    bound = 2 * idle_p99 + 2 * loaded["median_step_s"]
    return {"bound_s": bound, "met": loaded_p99 <= bound}
