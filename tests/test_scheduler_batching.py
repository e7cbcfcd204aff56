"""Request-level batching policies: static and dynamic (wait up to a window or a batch size, then
run the batch to completion), driven with fake outputs."""

from __future__ import annotations

from test_scheduler_priority import Clock, add, kinds, step

from scheduler.block_manager import BlockManager
from scheduler.config import SchedulerConfig
from scheduler.scheduler import Scheduler


def make(policy: str, max_seqs=3, window=1.0):
    clock = Clock()
    config = SchedulerConfig(
        max_num_seqs=max_seqs, max_batch_tokens=256, policy=policy, batch_window_s=window
    )
    return Scheduler(config, BlockManager(64, 4, 0), clock=clock), clock


def scheduled_ids(out) -> set[str]:
    return {r.request_id for r, _ in out.scheduled}


def test_dynamic_waits_for_the_window_then_runs_what_came():
    s, clock = make("dynamic", window=1.0)
    first = add(s, "a", 0, max_tokens=2)
    clock.now = 0.4
    add(s, "b", 0, max_tokens=2)
    assert not step(s).scheduled and s.seconds_until_runnable() == 0.6
    assert kinds(first) == ["queued", "waiting_for_batch"]
    clock.now = 1.0
    assert scheduled_ids(step(s)) == {"a", "b"}


def test_dynamic_starts_at_once_when_the_batch_is_full():
    s, clock = make("dynamic", max_seqs=2, window=60.0)
    add(s, "a", 0)
    assert not step(s).scheduled
    second = add(s, "b", 0)
    assert s.seconds_until_runnable() == 0.0
    assert "waiting_for_batch" not in kinds(second)  # it completed the batch
    assert scheduled_ids(step(s)) == {"a", "b"}


def test_dynamic_runs_a_batch_to_completion_before_the_next():
    s, clock = make("dynamic", max_seqs=2, window=0.0)
    add(s, "short", 0, max_tokens=1)
    add(s, "long", 0, max_tokens=4)
    step(s)
    late = add(s, "late", 0, max_tokens=1)
    assert kinds(late)[-1] == "waiting_for_batch"  # behind the running batch
    seen = set()
    while "long" in s.requests:
        seen |= scheduled_ids(step(s))
    assert "late" not in seen  # a slot freed when "short" ended, but membership is fixed
    assert scheduled_ids(step(s)) == {"late"}


def test_continuous_admits_into_a_running_batch():
    s, clock = make("fcfs", max_seqs=2)
    add(s, "short", 0, max_tokens=1)
    add(s, "long", 0, max_tokens=4)
    step(s)
    add(s, "late", 0, max_tokens=1)
    seen = set()
    while "long" in s.requests:
        seen |= scheduled_ids(step(s))
    assert "late" in seen and s.seconds_until_runnable() == 0.0
