"""Three processes (replicas) admitting at once against the real Redis never overshoot a limit."""

from __future__ import annotations

import asyncio
import multiprocessing
import os
import time

import pytest
import redis

from gateway.redis_client import make_redis
from gateway.tenancy.ratelimit import RateLimiter, TenantLimits

NUM_REPLICAS = 3
NUM_REQUESTS_EACH = 150


all_replicas_ready = None


def share_barrier(barrier) -> None:
    global all_replicas_ready
    all_replicas_ready = barrier


def admit_in_replica(url, limits, num_requests, now) -> tuple[int, int, int]:
    """One replica: once every replica is connected, fire `num_requests` concurrent admits.

    Returns (admitted, admitted tokens, degraded)."""
    return asyncio.run(admit_concurrently(url, limits, num_requests, now))


async def admit_concurrently(url, limits, num_requests, now):
    client = make_redis(url)
    limiter = RateLimiter(client)
    assert await limiter.load_scripts()
    all_replicas_ready.wait(timeout=60)
    admissions = await asyncio.gather(
        *(limiter.admit(limits, f"{os.getpid()}-{i}", 4, 6, now=now) for i in range(num_requests))
    )
    await client.aclose()
    admitted = [a for a in admissions if a.allowed]
    return (
        len(admitted),
        sum(a.reserved_tokens for a in admitted),
        sum(a.degraded for a in admissions),
    )


def run_replicas(url, limits, now=None) -> tuple[int, int]:
    context = multiprocessing.get_context("spawn")
    barrier = context.Barrier(NUM_REPLICAS)
    with context.Pool(NUM_REPLICAS, initializer=share_barrier, initargs=(barrier,)) as pool:
        args = [(url, limits, NUM_REQUESTS_EACH, now)] * NUM_REPLICAS
        results = pool.starmap(admit_in_replica, args)
    assert sum(degraded for _, _, degraded in results) == 0
    return sum(n for n, _, _ in results), sum(tokens for _, tokens, _ in results)


@pytest.fixture
def clean_redis(redis_url, unique_name):
    client = redis.Redis.from_url(redis_url)
    client.ping()  # the real Redis must be up: fail, never skip
    yield
    for key in client.scan_iter(match=f"*{unique_name}*"):
        client.delete(key)
    client.close()


@pytest.mark.slow
def test_monthly_quota_never_overshot_by_three_replicas(redis_url, unique_name, clean_redis):
    limits = TenantLimits(unique_name, monthly_token_quota=1234)
    num_admitted, tokens = run_replicas(redis_url, limits)  # Redis server time
    assert (num_admitted, tokens) == (123, 1230)


@pytest.mark.slow
def test_requests_and_tokens_per_minute_hold_across_three_replicas(
    redis_url, unique_name, clean_redis
):
    now = time.time()
    by_requests = TenantLimits(unique_name + "-rpm", rpm=100, burst=5)
    assert run_replicas(redis_url, by_requests, now=now)[0] == 105
    by_tokens = TenantLimits(unique_name + "-tpm", tpm=2005)
    assert run_replicas(redis_url, by_tokens, now=now) == (200, 2000)
