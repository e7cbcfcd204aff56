"""`gateway.metrics` without a server: names, labels and values read from a fake engine, request
observations, and the step rate. (Metrics moving on a live server: tests/test_admin_api.py.)"""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace

from prometheus_client.parser import text_string_to_metric_families

from gateway.metrics import Metrics, StepRate
from runtime.engine_client import EngineSnapshot, SequenceSnapshot


def sequence(priority: int = 0) -> SequenceSnapshot:
    return SequenceSnapshot("r-0", "acme", priority, "waiting", 5, 0, 0, 1, 0, 0, 0.0)


def fake_snapshot(waiting=(), num_running=0, num_swapped=0) -> EngineSnapshot:
    return EngineSnapshot(
        taken_at=0.0,
        running=(sequence(),) * num_running,
        waiting=tuple(sequence(p) for p in waiting),
        swapped=(sequence(),) * num_swapped,
        num_gpu_blocks=16,
        num_free_gpu_blocks=12,
        num_cpu_blocks=8,
        num_free_cpu_blocks=4,
        num_prefix_queries=100,
        num_prefix_hits=40,
        num_preemptions={"swap": 3, "recompute": 1},
        num_steps=0,
        mean_step_time_s=None,
    )


def samples(
    metrics: Metrics, snapshot: EngineSnapshot | None = None
) -> dict[tuple[str, tuple], float]:
    text = metrics.render(snapshot).decode()
    return {
        (sample.name, tuple(sorted(sample.labels.items()))): sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    }


def fake_tracker(tenant="acme", finish_reasons=None, num_choices=1):
    plan = SimpleNamespace(
        principal=SimpleNamespace(tenant=SimpleNamespace(name=tenant)),
        num_prompt_tokens=10,
        num_choices=num_choices,
        received_at=100.0,
        received_mono=0.0,
    )
    return SimpleNamespace(
        plan=plan,
        total_output_tokens=7,
        finish_reasons=finish_reasons if finish_reasons is not None else {0: "stop"},
        first_token_at=100.25,
        queue_time_s=0.05,
        inter_token_s=[0.02, 0.03],
    )


def test_engine_gauges_and_counters_are_read_at_scrape_time():
    snapshot = fake_snapshot(waiting=[0, 5, 5], num_running=2, num_swapped=1)
    metrics = Metrics()
    values = samples(metrics, snapshot)
    assert values[("conveyor:num_requests_running", ())] == 2
    assert values[("conveyor:num_requests_waiting", ())] == 3
    assert values[("conveyor:num_requests_swapped", ())] == 1
    assert values[("conveyor:num_requests_waiting_by_priority", (("priority", "5"),))] == 2
    assert values[("conveyor:kv_cache_usage_perc", ())] == 0.25
    assert values[("conveyor:cpu_kv_cache_usage_perc", ())] == 0.5
    assert values[("conveyor:prefix_cache_queries_total", ())] == 100
    assert values[("conveyor:prefix_cache_hits_total", ())] == 40
    assert values[("conveyor:num_preemptions_total", (("mode", "swap"),))] == 3
    emptied = samples(metrics, dataclasses.replace(snapshot, waiting=()))
    assert emptied[("conveyor:num_requests_waiting_by_priority", (("priority", "5"),))] == 0


def test_no_engine_yet_means_no_engine_series():
    values = samples(Metrics())
    assert not any(name == "conveyor:num_requests_running" for name, _ in values)


def test_request_observations():
    metrics = Metrics()
    metrics.observe_finished(fake_tracker(finish_reasons={0: "stop", 1: None}, num_choices=2))
    metrics.observe_refused("acme", "rate_limit_requests")
    values = samples(metrics)
    assert values[("conveyor:prompt_tokens_total", ())] == 10
    assert values[("conveyor:generation_tokens_total", ())] == 7
    assert values[("conveyor:request_success_total", (("finished_reason", "stop"),))] == 1
    assert values[("conveyor:request_success_total", (("finished_reason", "abort"),))] == 1
    assert (
        values[("conveyor:tenant_tokens_total", (("kind", "completion"), ("tenant", "acme")))] == 7
    )
    assert values[("conveyor:tenant_tokens_total", (("kind", "prompt"), ("tenant", "acme")))] == 10
    key = ("conveyor:rate_limited_total", (("reason", "rate_limit_requests"), ("tenant", "acme")))
    assert values[key] == 1
    assert values[("conveyor:time_to_first_token_seconds_count", ())] == 1
    assert values[("conveyor:time_to_first_token_seconds_sum", ())] == 0.25
    assert values[("conveyor:inter_token_latency_seconds_count", ())] == 2
    assert values[("conveyor:request_queue_time_seconds_sum", ())] == 0.05
    assert values[("conveyor:e2e_request_latency_seconds_count", ())] == 1
    assert not any(name.endswith("_created") for name, _ in values)


def test_each_app_has_its_own_registry():
    first, second = Metrics(), Metrics()
    first.observe_refused("acme", "concurrency")
    assert not any(name == "conveyor:rate_limited_total" for name, _ in samples(second))


def test_step_rate_over_a_window():
    rate = StepRate(window_s=10.0)
    assert rate.rate() is None
    for second in range(30):
        rate.sample(num_steps=second * 20, now=float(second))
    assert rate.rate() == 20.0
    assert rate.samples[0][0] >= 18.0  # older samples were dropped


def test_spec_decode_counters_only_with_speculation_on():
    from runtime.spec.stats import SpecDecodeStats

    assert not any("spec_decode" in name for name, _ in samples(Metrics(), fake_snapshot()))
    stats = SpecDecodeStats(num_speculative_tokens=3)
    stats.record(3, 2)
    stats.record(2, 0)
    snapshot = dataclasses.replace(fake_snapshot(), spec_decode=stats.snapshot())
    values = samples(Metrics(), snapshot)
    assert values[("conveyor:spec_decode_num_drafts_total", ())] == 2
    assert values[("conveyor:spec_decode_num_draft_tokens_total", ())] == 5
    assert values[("conveyor:spec_decode_num_accepted_tokens_total", ())] == 2
    per_pos = "conveyor:spec_decode_num_accepted_tokens_per_pos_total"
    assert [values[(per_pos, (("position", str(p)),))] for p in range(3)] == [1, 1, 0]
