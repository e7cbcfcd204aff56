"""Property tests of the scheduler with fake model outputs: random arrivals, lengths, priorities,
tenants, aborts and tiny caches. No torch, milliseconds per example."""

from __future__ import annotations

import random
from collections import Counter

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from scheduler.block_manager import BlockManager
from scheduler.config import SchedulerConfig
from scheduler.request import Request, RequestStatus, SamplingParams
from scheduler.scheduler import Scheduler

EOS = 0


class FakeClock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def make_scheduler(
    num_blocks, num_cpu_blocks, max_seqs, budget, policy="priority", mode="auto", block_size=4
):
    bm = BlockManager(num_blocks, block_size, num_cpu_blocks)
    config = SchedulerConfig(
        max_num_seqs=max_seqs, max_batch_tokens=budget, policy=policy, preemption_mode=mode
    )
    clock = FakeClock()
    return Scheduler(config, bm, clock=clock), clock


def check_blocks(scheduler: Scheduler) -> None:
    bm = scheduler.block_manager
    live = [r for r in scheduler.running + scheduler.waiting + scheduler.swapped]
    refs = Counter(b for r in live for b in r.block_ids)
    for block_id in range(bm.num_gpu_blocks):
        assert bm.pool.ref_counts[block_id] == refs[block_id], f"block {block_id} refcount drifted"
        assert (block_id in bm.pool.free_blocks) == (refs[block_id] == 0)
    cpu_held = [b for r in live for b in r.cpu_block_ids]
    assert len(cpu_held) == len(set(cpu_held)), "a CPU block is held twice"
    assert sorted(cpu_held + bm.free_cpu_blocks) == list(range(bm.num_cpu_blocks))
    for r in scheduler.waiting:
        assert not r.block_ids and not r.cpu_block_ids
    for r in scheduler.swapped:
        assert not r.block_ids and r.cpu_block_ids


def check_step(scheduler: Scheduler, out) -> None:
    config = scheduler.config
    assert out.num_scheduled_tokens <= config.max_batch_tokens
    assert len(scheduler.running) <= config.max_num_seqs
    assert len({id(r) for r, _ in out.scheduled}) == len(out.scheduled)
    for request, num_tokens in out.scheduled:
        assert request.status is RequestStatus.RUNNING
        assert 0 < num_tokens <= request.num_tokens - request.num_computed_tokens
        assert (
            len(request.block_ids) * scheduler.block_manager.block_size
            >= request.num_computed_tokens + num_tokens
        )
    if config.policy == "priority" and scheduler.running:
        least_urgent = max(r.priority for r in scheduler.running)
        for r in scheduler.waiting + scheduler.swapped:
            if r.priority < least_urgent and r.num_preemptions == 0:
                assert r.wait_reason is not None or out.budget == 0, (
                    "an urgent request waits for no reason"
                )


request_spec = st.tuples(
    st.integers(1, 40),  # prompt length
    st.integers(1, 20),  # max tokens
    st.integers(0, 3),  # priority
    st.sampled_from(["a", "b", "c"]),  # tenant
    st.integers(0, 30),  # arrival step
    st.booleans(),  # abort at some point
)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    specs=st.lists(request_spec, min_size=1, max_size=25),
    num_blocks=st.integers(11, 40),
    num_cpu_blocks=st.integers(0, 30),
    max_seqs=st.integers(1, 8),
    budget=st.integers(1, 64),
    policy=st.sampled_from(["priority", "fcfs", "static"]),
    mode=st.sampled_from(["auto", "swap", "recompute"]),
    seed=st.integers(0, 10_000),
)
def test_scheduler_invariants(
    specs, num_blocks, num_cpu_blocks, max_seqs, budget, policy, mode, seed
):
    rng = random.Random(seed)
    scheduler, clock = make_scheduler(num_blocks, num_cpu_blocks, max_seqs, budget, policy, mode)
    requests = []
    finished_count = Counter()
    pending = sorted(enumerate(specs), key=lambda s: s[1][4])
    for step in range(2000):
        clock.now = float(step)
        while pending and pending[0][1][4] <= step:
            i, (prompt_len, max_tokens, priority, tenant, _, _) = pending.pop(0)
            prompt = [rng.randrange(1, 50) for _ in range(prompt_len)]
            r = Request(
                f"r{i}",
                prompt,
                SamplingParams(max_tokens=max_tokens),
                priority,
                tenant,
                arrival_time=clock.now,
                eos_token_ids=(EOS,),
            )
            scheduler.add_request(r)
            requests.append((r, specs[i][5]))
        for r, wants_abort in requests:
            if wants_abort and not r.is_finished and rng.random() < 0.05:
                scheduler.abort(r.request_id)
        out = scheduler.schedule()
        check_step(scheduler, out)
        sampled = {
            r.request_id: [rng.randrange(0, 50)]
            for r, n in out.scheduled
            if r.num_computed_tokens + n == r.num_tokens
        }
        scheduler.mark_launched(out)
        scheduler.update_from_output(out, sampled)
        check_blocks(scheduler)
        if not pending and not scheduler.has_unfinished():
            break
    assert not scheduler.has_unfinished(), "the scheduler stalled"
    for r, _ in requests:
        assert r.is_finished
        finished_count[r.request_id] += 1
        assert sum(e.kind in ("finished", "aborted") for e in r.events) == 1
    assert scheduler.block_manager.num_free_gpu_blocks == num_blocks
    assert scheduler.block_manager.num_free_cpu_blocks == num_cpu_blocks


def run_tenants(weights: dict[str, float], steps: int = 400) -> Counter:
    """Each tenant keeps 20 identical requests waiting; count the tokens each is served."""
    scheduler, clock = make_scheduler(200, 0, 4, 16)
    served = Counter()
    counter = 0
    for step in range(steps):
        clock.now = float(step)
        for tenant, weight in weights.items():
            while sum(1 for r in scheduler.requests.values() if r.tenant == tenant) < 20:
                counter += 1
                r = Request(
                    f"{tenant}{counter}",
                    [1] * 8,
                    SamplingParams(max_tokens=8, ignore_eos=True),
                    0,
                    tenant,
                    weight,
                    arrival_time=clock.now,
                )
                scheduler.add_request(r)
        out = scheduler.schedule()
        for r, n in out.scheduled:
            served[r.tenant] += n
        sampled = {
            r.request_id: [5] for r, n in out.scheduled if r.num_computed_tokens + n == r.num_tokens
        }
        scheduler.mark_launched(out)
        scheduler.update_from_output(out, sampled)
    return served


def test_equal_tenants_get_equal_service():
    served = run_tenants({"a": 1.0, "b": 1.0})
    assert abs(served["a"] - served["b"]) <= 0.1 * max(served.values())


def test_weighted_tenants_get_weighted_service():
    served = run_tenants({"heavy": 2.0, "light": 1.0})
    assert 1.8 <= served["heavy"] / served["light"] <= 2.2


def test_one_step_shares_its_admissions_between_tenants():
    """The line is re-ordered after each admission: a tenant first in line cannot take a whole
    step's budget while an equal tenant waits behind it."""
    scheduler, clock = make_scheduler(200, 0, 8, 64)
    params = SamplingParams(max_tokens=4, ignore_eos=True)
    for tenant in ("a", "b"):  # all of a's requests arrive before b's
        for i in range(4):
            clock.now += 1.0
            prompt = [int(clock.now)] * 16  # distinct prompts: no prefix-cache hits
            scheduler.add_request(
                Request(f"{tenant}{i}", prompt, params, 0, tenant, 1.0, clock.now)
            )
    out = scheduler.schedule()
    assert [r.tenant for r, _ in out.scheduled] == ["a", "b", "a", "b"]
    assert scheduler.order.tenant_service["a"] == scheduler.order.tenant_service["b"] == 32
