"""Prometheus metrics, vLLM-style names under `conveyor:`, one registry per application.

Request metrics are observed by the gateway when an HTTP request settles (`observe_finished`) or
is refused (`observe_refused`). Engine gauges and counters are read at scrape time from the live
engine by `EngineCollector`, with plain attribute reads and list copies only: the engine thread
is never locked or waited for.

    conveyor:num_requests_running / _waiting / _swapped        gauges
    conveyor:num_requests_waiting_by_priority{priority}        gauge (the Helm dashboard)
    conveyor:kv_cache_usage_perc, cpu_kv_cache_usage_perc      gauges, fractions 0..1
    conveyor:prefix_cache_queries_total, _hits_total           counters (tokens)
    conveyor:num_preemptions_total{mode}                       counter (swap | recompute)
    conveyor:prompt_tokens_total, generation_tokens_total      counters
    conveyor:request_success_total{finished_reason}            counter (one per sequence)
    conveyor:time_to_first_token_seconds, inter_token_latency_seconds,
    conveyor:e2e_request_latency_seconds, request_queue_time_seconds   histograms
    conveyor:rate_limited_total{tenant,reason}                 counter (refusals by reason)
    conveyor:tenant_tokens_total{tenant,kind}                  counter (kind: prompt | completion)
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

import prometheus_client
from aiohttp import web
from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from gateway.appkeys import ENGINE, METRICS

prometheus_client.disable_created_metrics()  # no `_created` series, as vLLM

PREFIX = "conveyor:"
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5,
                5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)  # fmt: skip
ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0,
               7.5, 10.0, 20.0, 40.0, 80.0)  # fmt: skip
LATENCY_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0,
                   60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)  # fmt: skip
STEP_RATE_WINDOW_S = 10.0
STEP_SAMPLE_INTERVAL_S = 1.0


class Metrics:
    def __init__(self, get_engine: Callable[[], Any] = lambda: None) -> None:
        self.registry = CollectorRegistry()
        self.step_rate = StepRate()
        self.registry.register(EngineCollector(get_engine))
        r = self.registry
        self.prompt_tokens = Counter(
            PREFIX + "prompt_tokens", "Prompt tokens of finished requests.", registry=r
        )
        self.generation_tokens = Counter(
            PREFIX + "generation_tokens", "Generated tokens.", registry=r
        )
        self.request_success = Counter(
            PREFIX + "request_success",
            "Finished sequences by finish reason.",
            ["finished_reason"],
            registry=r,
        )
        self.rate_limited = Counter(
            PREFIX + "rate_limited",
            "Requests refused before generation, by tenant and reason.",
            ["tenant", "reason"],
            registry=r,
        )
        self.tenant_tokens = Counter(
            PREFIX + "tenant_tokens", "Tokens by tenant and kind.", ["tenant", "kind"], registry=r
        )
        self.ttft = Histogram(
            PREFIX + "time_to_first_token_seconds",
            "Received to first token.",
            buckets=TTFT_BUCKETS,
            registry=r,
        )
        self.itl = Histogram(
            PREFIX + "inter_token_latency_seconds",
            "Gap between consecutive tokens of a sequence.",
            buckets=ITL_BUCKETS,
            registry=r,
        )
        self.e2e = Histogram(
            PREFIX + "e2e_request_latency_seconds",
            "Received to completed.",
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.queue_time = Histogram(
            PREFIX + "request_queue_time_seconds",
            "Time in the engine's waiting line before first being scheduled.",
            buckets=LATENCY_BUCKETS,
            registry=r,
        )

    # ---- what the gateway observes ----------------------------------------------------------
    def observe_finished(self, tracker: Any) -> None:
        """An admitted request has settled (`gateway.openai_api.Tracker`)."""
        plan = tracker.plan
        tenant = plan.principal.tenant.name
        num_generated = tracker.total_output_tokens
        self.prompt_tokens.inc(plan.num_prompt_tokens)
        self.generation_tokens.inc(num_generated)
        self.tenant_tokens.labels(tenant, "prompt").inc(plan.num_prompt_tokens)
        self.tenant_tokens.labels(tenant, "completion").inc(num_generated)
        for choice in range(plan.num_choices):
            reason = tracker.finish_reasons.get(choice) or "abort"
            self.request_success.labels(reason).inc()
        now = time.monotonic()
        self.e2e.observe(now - plan.received_mono)
        if tracker.first_token_at is not None:
            self.ttft.observe(tracker.first_token_at - plan.received_at)
        if tracker.queue_time_s is not None:
            self.queue_time.observe(tracker.queue_time_s)
        for gap in tracker.inter_token_s:
            self.itl.observe(gap)

    def observe_refused(self, tenant: str, reason: str) -> None:
        self.rate_limited.labels(tenant, reason).inc()

    def render(self) -> bytes:
        return prometheus_client.generate_latest(self.registry)


class StepRate:
    """Engine steps per second over the last `window_s`, from (time, num_steps) samples."""

    def __init__(self, window_s: float = STEP_RATE_WINDOW_S) -> None:
        self.window_s = window_s
        self.samples: collections.deque[tuple[float, int]] = collections.deque()

    def sample(self, num_steps: int, now: float | None = None) -> None:
        now = time.monotonic() if now is None else now
        self.samples.append((now, num_steps))
        while len(self.samples) > 2 and now - self.samples[1][0] >= self.window_s:
            self.samples.popleft()

    def rate(self) -> float | None:
        if len(self.samples) < 2:
            return None
        (start, first_steps), (end, last_steps) = self.samples[0], self.samples[-1]
        return (last_steps - first_steps) / (end - start) if end > start else None


class EngineCollector:
    """Engine state at scrape time; the engine thread keeps running meanwhile."""

    def __init__(self, get_engine: Callable[[], Any]) -> None:
        self.get_engine = get_engine
        self.priorities_seen: set[int] = set()  # report 0, not nothing, once a level has gone

    def describe(self):
        return []  # collected lazily: the engine may not be loaded yet

    def collect(self):
        async_engine = self.get_engine()
        if async_engine is None:
            return
        engine = async_engine.engine
        scheduler, blocks = engine.scheduler, engine.block_manager
        waiting, running, swapped = (
            list(scheduler.waiting),
            list(scheduler.running),
            list(scheduler.swapped),
        )
        yield gauge("num_requests_running", "Sequences running on the engine.", len(running))
        yield gauge("num_requests_waiting", "Sequences waiting for the engine.", len(waiting))
        yield gauge("num_requests_swapped", "Sequences swapped out to CPU.", len(swapped))
        yield self.waiting_by_priority(waiting)
        yield gauge("kv_cache_usage_perc", "GPU KV cache usage (0..1).", blocks.gpu_usage)
        cpu_usage = blocks.cpu_usage if blocks.num_cpu_blocks else 0.0
        yield gauge("cpu_kv_cache_usage_perc", "CPU swap pool usage (0..1).", cpu_usage)
        yield counter(
            "prefix_cache_queries", "Prompt tokens looked up in the prefix cache.",
            blocks.num_prefix_queries,
        )  # fmt: skip
        yield counter(
            "prefix_cache_hits", "Prompt tokens found in the prefix cache.", blocks.num_prefix_hits
        )
        preemptions = CounterMetricFamily(
            PREFIX + "num_preemptions", "Preemptions by mode.", labels=["mode"]
        )
        for mode, count in dict(scheduler.num_preemptions).items():
            preemptions.add_metric([mode], count)
        yield preemptions

    def waiting_by_priority(self, waiting: list[Any]) -> GaugeMetricFamily:
        counts = collections.Counter(request.priority for request in waiting)
        self.priorities_seen.update(counts)
        family = GaugeMetricFamily(
            PREFIX + "num_requests_waiting_by_priority",
            "Sequences waiting, by priority (lower is more urgent).",
            labels=["priority"],
        )
        for priority in sorted(self.priorities_seen):
            family.add_metric([str(priority)], counts.get(priority, 0))
        return family


def gauge(name: str, documentation: str, value: float) -> GaugeMetricFamily:
    return GaugeMetricFamily(PREFIX + name, documentation, value=value)


def counter(name: str, documentation: str, value: float) -> CounterMetricFamily:
    return CounterMetricFamily(PREFIX + name, documentation, value=value)


# ---- the application side ----------------------------------------------------------------------
def install(app: web.Application) -> None:
    """A registry for this app, `GET /metrics`, and the step-rate sampler."""
    app[METRICS] = Metrics(lambda: app.get(ENGINE))
    app.router.add_get("/metrics", metrics_handler)
    app.cleanup_ctx.append(step_rate_ctx)


async def metrics_handler(request: web.Request) -> web.Response:
    body = request.app[METRICS].render()
    return web.Response(body=body, headers={"Content-Type": prometheus_client.CONTENT_TYPE_LATEST})


async def step_rate_ctx(app: web.Application) -> AsyncIterator[None]:
    task = asyncio.create_task(sample_step_rate(app), name="step-rate-sampler")
    yield
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task


async def sample_step_rate(app: web.Application) -> None:
    while True:
        engine = app.get(ENGINE)
        if engine is not None:
            app[METRICS].step_rate.sample(engine.engine.num_steps)
        await asyncio.sleep(STEP_SAMPLE_INTERVAL_S)
