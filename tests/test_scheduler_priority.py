"""Priorities, preemption by swap or recompute, aging and delay events, driven with fake outputs."""

from __future__ import annotations

from scheduler.block_manager import BlockManager
from scheduler.config import PreemptionCostModel, SchedulerConfig
from scheduler.request import Request, RequestStatus, SamplingParams
from scheduler.scheduler import Scheduler


class Clock:
    now = 0.0

    def __call__(self):
        return self.now


def make(num_blocks=64, num_cpu=64, max_seqs=4, budget=64, mode="swap", aging=None, cost=None):
    clock = Clock()
    config = SchedulerConfig(
        max_num_seqs=max_seqs, max_batch_tokens=budget, preemption_mode=mode, priority_aging_s=aging
    )
    return Scheduler(config, BlockManager(num_blocks, 4, num_cpu), cost, clock=clock), clock


def add(scheduler, rid, priority, prompt_len=4, max_tokens=50, tenant="t", now=None):
    base = 1000 * (len(scheduler.requests) + 1)  # distinct prompts: no prefix-cache sharing
    r = Request(
        rid,
        list(range(base, base + prompt_len)),
        SamplingParams(max_tokens=max_tokens, ignore_eos=True),
        priority,
        tenant,
        arrival_time=scheduler.clock() if now is None else now,
    )
    scheduler.add_request(r)
    return r


def step(scheduler):
    out = scheduler.schedule()
    sampled = {
        r.request_id: [7] for r, n in out.scheduled if r.num_computed_tokens + n == r.num_tokens
    }
    scheduler.mark_launched(out)
    scheduler.update_from_output(out, sampled)
    return out


def kinds(request):
    return [e.kind for e in request.events]


def test_urgent_request_preempts_least_urgent_latest_when_slots_are_full():
    s, clock = make(max_seqs=2)
    old = add(s, "old", 5)
    clock.now = 1
    young = add(s, "young", 5)
    step(s)
    clock.now = 2
    urgent = add(s, "urgent", 0)
    out = step(s)
    assert [r.request_id for r in out.preempted] == ["young"]
    assert urgent.status is RequestStatus.RUNNING and old.status is RequestStatus.RUNNING
    assert young.status is RequestStatus.SWAPPED and young.cpu_block_ids
    preempted = next(e for e in young.events if e.kind == "preempted")
    assert preempted.data["mode"] == "swap" and preempted.data["by"] == "urgent"
    assert preempted.data["by_priority"] == 0 and preempted.data["by_tenant"] == "t"


def test_equal_priority_never_preempts():
    s, clock = make(max_seqs=1)
    first = add(s, "first", 1)
    step(s)
    clock.now = 1
    second = add(s, "second", 1)
    out = step(s)
    assert not out.preempted and second.status is RequestStatus.WAITING
    assert second.wait_reason == "waiting_for_slot" and "waiting_for_slot" in kinds(second)
    assert first.status is RequestStatus.RUNNING


def test_kv_pressure_preempts_by_recompute_and_the_victim_resumes_first_in_line():
    s, clock = make(num_blocks=6, num_cpu=0, max_seqs=8, mode="recompute")
    low = add(s, "low", 3, prompt_len=12, max_tokens=3)  # 3 blocks, then a 4th to grow
    step(s)
    clock.now = 1
    urgent = add(s, "urgent", 0, prompt_len=12, max_tokens=3)
    late = add(s, "late", 3, prompt_len=4, max_tokens=2)
    out = step(s)
    assert (
        low in out.preempted
        and low.status is RequestStatus.WAITING
        and low.num_computed_tokens == 0
    )
    assert late.status is RequestStatus.WAITING  # it waits behind the preempted request
    behind = next(e for e in late.events if e.kind == "waiting_behind")
    assert behind.data["by"] == "low" and behind.data["by_priority"] == 3
    while s.has_unfinished():
        step(s)
    resumed_at = next(e.time for e in low.events if e.kind == "resumed")
    late_start = next(e.time for e in late.events if e.kind == "scheduled")
    assert resumed_at <= late_start  # the preempted request kept its place ahead of a later arrival
    assert kinds(low)[-1] == "finished" and "recompute_started" in kinds(low)
    assert low.output_token_ids == [7, 7, 7] and urgent.num_output_tokens == 3


def test_swapped_request_comes_back_with_its_blocks():
    s, clock = make(num_blocks=5, num_cpu=8, max_seqs=8, mode="swap")
    low = add(s, "low", 3, prompt_len=12, max_tokens=4)
    step(s)
    clock.now = 1
    add(s, "urgent", 0, prompt_len=8, max_tokens=2)
    out = step(s)
    assert out.blocks_to_swap_out and low.status is RequestStatus.SWAPPED
    assert [g for g, _ in out.blocks_to_swap_out] and len(low.cpu_block_ids) == len(
        out.blocks_to_swap_out
    )
    while low.status is RequestStatus.SWAPPED:
        out = step(s)
    assert out.blocks_to_swap_in and not low.cpu_block_ids
    assert "swapped_in" in kinds(low) and "resumed" in kinds(low)
    while s.has_unfinished():
        step(s)
    assert low.num_output_tokens == 4 and s.block_manager.num_free_cpu_blocks == 8


def test_abort_while_swapped_frees_cpu_blocks():
    s, clock = make(num_blocks=5, num_cpu=8, max_seqs=8, mode="swap")
    low = add(s, "low", 3, prompt_len=12)
    step(s)
    add(s, "urgent", 0, prompt_len=8)
    step(s)
    assert low.status is RequestStatus.SWAPPED
    s.abort("low")
    assert low.status is RequestStatus.FINISHED_ABORTED and kinds(low)[-1] == "aborted"
    assert s.block_manager.num_free_cpu_blocks == 8


def test_auto_mode_follows_the_cost_model():
    cheap_copy = PreemptionCostModel(
        bytes_per_block=1000, copy_bytes_per_s=1e12, prefill_tokens_per_s=100
    )
    costly_copy = PreemptionCostModel(
        bytes_per_block=10**9, copy_bytes_per_s=1e6, prefill_tokens_per_s=1e9
    )
    for cost, expected in ((cheap_copy, "swap"), (costly_copy, "recompute")):
        s, _ = make(num_blocks=5, num_cpu=8, mode="auto", cost=cost)
        low = add(s, "low", 3, prompt_len=12)
        step(s)
        add(s, "urgent", 0, prompt_len=8)
        step(s)
        assert low.preempted_mode == expected


def test_auto_mode_falls_back_to_recompute_when_the_swap_pool_is_full():
    cheap_copy = PreemptionCostModel(
        bytes_per_block=1, copy_bytes_per_s=1e12, prefill_tokens_per_s=1
    )
    s, _ = make(num_blocks=5, num_cpu=1, mode="auto", cost=cheap_copy)
    low = add(s, "low", 3, prompt_len=12)
    step(s)
    add(s, "urgent", 0, prompt_len=8)
    step(s)
    assert low.preempted_mode == "recompute"


def test_aging_lets_an_old_low_priority_request_overtake():
    s, clock = make(max_seqs=1, aging=10.0)
    add(s, "busy", 0, max_tokens=1000)
    step(s)
    old = add(s, "old-low", 5, now=0.0)
    clock.now = 100.0  # ten levels of aging: effective priority -5
    fresh = add(s, "fresh-high", 1)
    line = sorted(s.waiting, key=lambda r: s.order.line_key(r, clock.now))
    assert line[0] is old and s.order.effective_priority(old, clock.now) == -5
    out = step(s)
    assert old.status is RequestStatus.RUNNING and fresh.status is RequestStatus.WAITING
    assert out.preempted[0].request_id == "busy"


def test_queued_event_names_who_is_ahead():
    s, clock = make(max_seqs=1)
    add(s, "a", 0, tenant="acme")
    add(s, "b", 1, tenant="globex")
    late = add(s, "c", 2, tenant="initech")
    queued = late.events[0]
    assert queued.kind == "queued" and queued.data["num_ahead"] == 2
    assert queued.data["ahead_tenants"] == ["acme", "globex"] and queued.data[
        "ahead_priorities"
    ] == [0, 1]


def test_each_later_chunk_of_a_prompt_is_recorded_and_decodes_are_not():
    scheduler, clock = make(budget=16)
    request = add(scheduler, "long", 0, prompt_len=40, max_tokens=3)
    while scheduler.has_unfinished():
        clock.now += 1.0
        step(scheduler)
    kinds = [(e.kind, e.data.get("num_tokens")) for e in request.events]
    scheduled = [k for k in kinds if k[0] in ("scheduled", "prefill_chunk")]
    assert scheduled == [("scheduled", 16), ("prefill_chunk", 16), ("prefill_chunk", 8)]
    chunks = [e for e in request.events if e.kind == "prefill_chunk"]
    assert [e.data["num_computed_tokens"] for e in chunks] == [16, 32]
