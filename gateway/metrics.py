"""Prometheus metrics, vLLM-style names under `conveyor:`, one registry per application.

Request metrics are observed by the gateway when an HTTP request settles (`observe_finished`) or
is refused (`observe_refused`). Engine gauges and counters come from the `EngineSnapshot` the scrape
takes first (`EngineClient.snapshot`, copied on the engine thread between two steps).

    conveyor:num_requests_running / _waiting / _swapped        gauges
    conveyor:num_requests_waiting_by_priority{priority}        gauge (the Helm dashboard)
    conveyor:kv_cache_usage_perc, cpu_kv_cache_usage_perc      gauges, fractions 0..1
    conveyor:cache_config_info{block_size,num_gpu_blocks}      info gauge (1), vLLM's shape
    conveyor:model_weight_bytes_per_token                      gauge (bytes a decode step reads)
    conveyor:prefix_cache_queries_total, _hits_total           counters (tokens)
    conveyor:num_preemptions_total{mode}                       counter (swap | recompute)
    conveyor:prompt_tokens_total, generation_tokens_total      counters
    conveyor:request_success_total{finished_reason}            counter (one per sequence)
    conveyor:time_to_first_token_seconds, inter_token_latency_seconds,
    conveyor:e2e_request_latency_seconds, request_queue_time_seconds   histograms
    conveyor:rate_limited_total{tenant,reason}                 counter (refusals by reason)
    conveyor:tenant_tokens_total{tenant,kind}                  counter (kind: prompt | completion)
    conveyor:spec_decode_num_drafts_total, _num_draft_tokens_total, _num_accepted_tokens_total,
    conveyor:spec_decode_num_accepted_tokens_per_pos_total{position}   counters (speculation on)
"""

from __future__ import annotations

import collections
import time
from typing import TYPE_CHECKING, Any

import prometheus_client
from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

if TYPE_CHECKING:
    from runtime.engine_client import EngineInfo, EngineSnapshot

prometheus_client.disable_created_metrics()  # no `_created` series, as vLLM

PREFIX = "conveyor:"
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5,
                5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)  # fmt: skip
ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0,
               7.5, 10.0, 20.0, 40.0, 80.0)  # fmt: skip
LATENCY_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0,
                   60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)  # fmt: skip
GRAMMAR_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)
STEP_RATE_WINDOW_S = 10.0
STEP_SAMPLE_INTERVAL_S = 1.0


class Metrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self.step_rate = StepRate()
        self.engine_collector = EngineCollector()
        self.registry.register(self.engine_collector)
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
        self.grammar_compile = Histogram(
            PREFIX + "grammar_compile_seconds",
            "Time to compile a request's grammar (structured outputs, tool calls); cache hits "
            "count as 0.",
            buckets=GRAMMAR_BUCKETS,
            registry=r,
        )
        self.constrained_requests = Counter(
            PREFIX + "constrained_requests",
            "Requests decoded under a grammar, by kind and grammar cache outcome.",
            ["kind", "cache"],
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
        """An admitted request has settled (`gateway.openai.tracking.Tracker`)."""
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

    def observe_grammar(self, kind: str, compile_s: float, cache_hit: bool) -> None:
        self.grammar_compile.observe(compile_s)
        self.constrained_requests.labels(kind, "hit" if cache_hit else "miss").inc()

    def observe_refused(self, tenant: str, reason: str) -> None:
        self.rate_limited.labels(tenant, reason).inc()

    def render(
        self, snapshot: EngineSnapshot | None = None, info: EngineInfo | None = None
    ) -> bytes:
        """The exposition text; engine series only with a snapshot (none before the model)."""
        self.engine_collector.snapshot = snapshot
        self.engine_collector.info = info
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
    """Engine series from the snapshot of the scrape being rendered."""

    def __init__(self) -> None:
        self.snapshot: EngineSnapshot | None = None
        self.info: EngineInfo | None = None  # the model's fixed facts
        self.priorities_seen: set[int] = set()  # report 0, not nothing, once a level has gone

    def describe(self):
        return []  # collected lazily: the engine may not be loaded yet

    def collect(self):
        snapshot = self.snapshot
        if snapshot is None:
            return
        yield gauge(
            "num_requests_running", "Sequences running on the engine.", len(snapshot.running)
        )
        yield gauge(
            "num_requests_waiting", "Sequences waiting for the engine.", len(snapshot.waiting)
        )
        yield gauge("num_requests_swapped", "Sequences swapped out to CPU.", len(snapshot.swapped))
        yield self.waiting_by_priority(snapshot.waiting)
        yield gauge("kv_cache_usage_perc", "GPU KV cache usage (0..1).", snapshot.gpu_kv_usage)
        yield gauge("cpu_kv_cache_usage_perc", "CPU swap pool usage (0..1).", snapshot.cpu_kv_usage)
        if self.info is not None:
            yield cache_config_info(self.info.block_size, snapshot.num_gpu_blocks)
            yield gauge(
                "model_weight_bytes_per_token",
                "Weight bytes one decode step reads (quantized blocks as kept in memory).",
                self.info.weight_bytes_per_token,
            )
        yield counter(
            "prefix_cache_queries", "Prompt tokens looked up in the prefix cache.",
            snapshot.num_prefix_queries,
        )  # fmt: skip
        yield counter(
            "prefix_cache_hits",
            "Prompt tokens found in the prefix cache.",
            snapshot.num_prefix_hits,
        )
        preemptions = CounterMetricFamily(
            PREFIX + "num_preemptions", "Preemptions by mode.", labels=["mode"]
        )
        for mode, count in snapshot.num_preemptions.items():
            preemptions.add_metric([mode], count)
        yield preemptions
        if snapshot.spec_decode is not None:
            yield from spec_decode_counters(snapshot.spec_decode)

    def waiting_by_priority(self, waiting) -> GaugeMetricFamily:
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


def cache_config_info(block_size: int, num_gpu_blocks: int) -> GaugeMetricFamily:
    """The KV cache's shape in labels, as vLLM's `cache_config_info` (the endpoint picker reads
    `block_size` and `num_gpu_blocks` from it)."""
    family = GaugeMetricFamily(
        PREFIX + "cache_config_info",
        "KV cache configuration (value 1; the facts are the labels).",
        labels=["block_size", "num_gpu_blocks"],
    )
    family.add_metric([str(block_size), str(num_gpu_blocks)], 1)
    return family


def spec_decode_counters(snapshot: dict):
    """Speculative decoding's counters, named as vLLM's (runtime.spec.stats)."""
    from runtime.spec import stats

    yield CounterMetricFamily(
        stats.NUM_DRAFTS, "Rows verified with drafts.", value=snapshot[stats.NUM_DRAFTS]
    )
    yield CounterMetricFamily(
        stats.NUM_DRAFT_TOKENS, "Draft tokens verified.", value=snapshot[stats.NUM_DRAFT_TOKENS]
    )
    yield CounterMetricFamily(
        stats.NUM_ACCEPTED_TOKENS,
        "Draft tokens accepted.",
        value=snapshot[stats.NUM_ACCEPTED_TOKENS],
    )
    per_position = CounterMetricFamily(
        stats.NUM_ACCEPTED_TOKENS_PER_POS,
        "Draft tokens accepted, by position (0: the first draft).",
        labels=["position"],
    )
    for position, count in enumerate(snapshot[stats.NUM_ACCEPTED_TOKENS_PER_POS]):
        per_position.add_metric([str(position)], count)
    yield per_position


def gauge(name: str, documentation: str, value: float) -> GaugeMetricFamily:
    return GaugeMetricFamily(PREFIX + name, documentation, value=value)


def counter(name: str, documentation: str, value: float) -> CounterMetricFamily:
    return CounterMetricFamily(PREFIX + name, documentation, value=value)
