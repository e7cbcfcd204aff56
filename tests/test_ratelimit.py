"""Rate limits, token reservations, quotas and leases, against fakeredis and the real Redis."""

from __future__ import annotations

import asyncio
import random
from datetime import datetime, timedelta, timezone

import pytest
from redis.crc import key_slot

from gateway.redis_client import make_redis
from gateway.tenancy.ratelimit import (
    Admission,
    RateLimiter,
    TenantKeys,
    TenantLimits,
    format_reset,
    hash_tag,
)

# 2025-03-10 12:00:00 UTC: the start of a minute, mid-day, mid-month.
T0 = datetime(2025, 3, 10, 12, 0, tzinfo=timezone.utc).timestamp()


@pytest.fixture(params=["fakeredis", "redis"])
async def redis_client(request, redis_url, unique_name):
    client = make_redis(None if request.param == "fakeredis" else redis_url)
    await client.ping()  # the real Redis must be up: fail, never skip
    yield client
    async for key in client.scan_iter(match=f"conveyor:rl:{{{unique_name}*"):
        await client.delete(key)
    await client.aclose()


@pytest.fixture
def limiter(redis_client) -> RateLimiter:
    return RateLimiter(redis_client, burst=0, lease_ttl_s=30)


def limits_for(tenant: str, **limits) -> TenantLimits:
    return TenantLimits(tenant=tenant, **limits)


async def admit_one(limiter, limits, now, request_id="r", prompt_tokens=1, max_tokens=0):
    return await limiter.admit(limits, request_id, prompt_tokens, max_tokens, now=now)


# --- formatting and keys -------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("seconds", "text"),
    [
        (0, "0s"),
        (0.12, "120ms"),
        (0.0004, "1ms"),
        (1, "1s"),
        (1.5, "1.5s"),
        (7.66, "7.66s"),
        (60, "1m0s"),
        (360, "6m0s"),
        (179.56, "2m59.56s"),
        (7200, "2h0m0s"),
    ],
)
def test_format_reset_like_openai(seconds, text):
    assert format_reset(seconds) == text


def test_headers_of_a_refusal():
    admission = Admission(
        allowed=False,
        reason="rate_limit_requests",
        retry_after=1.2,
        limit_requests=60,
        remaining_requests=0,
        reset_requests=6.0,
        limit_tokens=1000,
        remaining_tokens=250,
        reset_tokens=0.12,
    )
    assert admission.headers() == {
        "x-ratelimit-limit-requests": "60",
        "x-ratelimit-remaining-requests": "0",
        "x-ratelimit-reset-requests": "6s",
        "x-ratelimit-limit-tokens": "1000",
        "x-ratelimit-remaining-tokens": "250",
        "x-ratelimit-reset-tokens": "120ms",
        "Retry-After": "2",
    }
    assert admission.code == "rate_limit_exceeded"
    assert admission.http_status == 429


def test_quota_refusals_say_insufficient_quota():
    for reason in ("daily_quota", "monthly_quota"):
        assert Admission(allowed=False, reason=reason, retry_after=5).code == "insufficient_quota"


def test_hash_tag_escapes_braces():
    assert hash_tag("acme") == "{acme}"
    assert hash_tag("a{b}c") == "{a%7Bb%7Dc}"
    assert hash_tag("a%7Bb") != hash_tag("a{b")
    assert hash_tag("") == "{%}"


def test_all_key_names_of_a_tenant_share_one_slot():
    keys = TenantKeys.of("we{ird}")
    names = [keys.gcra, keys.tokens_minute, keys.tokens_day, keys.tokens_month, keys.leases]
    names.append(keys.reservation("req-{1}"))
    assert all(name.startswith("conveyor:rl:{we%7Bird%7D}:") for name in names)
    assert len({key_slot(name.encode()) for name in names}) == 1


async def test_every_key_written_for_a_tenant_carries_its_tag(limiter, redis_client, unique_name):
    limits = limits_for(
        unique_name, rpm=10, burst=3, tpm=100, max_concurrency=2, daily_token_quota=100
    )
    await admit_one(limiter, limits, T0, "r1", 5, 5)
    await admit_one(limiter, limits, T0 + 1, "r2", 5, 5)
    await limiter.complete(limits, "r1", 10, 3)
    written = [key async for key in redis_client.scan_iter(match=f"*{unique_name}*")]
    assert len(written) == 6  # gcra, tpm, day, month, leases, reservation of r2
    assert all(f"{{{unique_name}}}".encode() in key for key in written)
    assert len({key_slot(key) for key in written}) == 1


# --- requests per minute (GCRA) ---------------------------------------------------------------


async def test_gcra_admits_burst_at_once_then_refuses(limiter, unique_name):
    limits = limits_for(unique_name, rpm=60, burst=4)
    admitted = [await admit_one(limiter, limits, T0, f"r{i}") for i in range(5)]
    assert all(a.allowed for a in admitted)
    assert [a.remaining_requests for a in admitted] == [4, 3, 2, 1, 0]
    refused = await admit_one(limiter, limits, T0, "r5")
    assert (refused.allowed, refused.reason, refused.code) == (
        False,
        "rate_limit_requests",
        "rate_limit_exceeded",
    )
    assert refused.retry_after == pytest.approx(1.0)
    assert refused.headers()["Retry-After"] == "1"


async def test_gcra_admits_again_after_retry_after(limiter, unique_name):
    limits = limits_for(unique_name, rpm=6)  # one request every 10 s
    assert (await admit_one(limiter, limits, T0, "a")).allowed
    refused = await admit_one(limiter, limits, T0 + 4, "b")
    assert refused.retry_after == pytest.approx(6.0)
    assert not (await admit_one(limiter, limits, T0 + 9.9, "c")).allowed
    assert (await admit_one(limiter, limits, T0 + 4 + refused.retry_after, "d")).allowed


async def test_gcra_never_exceeds_rpm_plus_burst_in_any_minute(limiter, unique_name):
    rpm, burst = 30, 5
    steady = limits_for(unique_name + "-steady", rpm=rpm, burst=burst)
    every_quarter_second = [T0 + i / 4 for i in range(4 * 150)]
    admitted = await admitted_times(limiter, steady, every_quarter_second)
    assert most_in_one_minute(admitted) == rpm + burst
    jittery = limits_for(unique_name + "-jittery", rpm=rpm, burst=burst)
    random_times = sorted(T0 + random.Random(7).uniform(0, 150) for _ in range(300))
    assert most_in_one_minute(await admitted_times(limiter, jittery, random_times)) <= rpm + burst


async def admitted_times(limiter, limits, arrivals):
    admissions = [await admit_one(limiter, limits, t, f"r{i}") for i, t in enumerate(arrivals)]
    return [t for t, admission in zip(arrivals, admissions) if admission.allowed]


def most_in_one_minute(times):
    return max(sum(1 for t in times if start <= t < start + 60) for start in times)


async def test_unlimited_tenant_gets_no_headers_but_usage_is_counted(limiter, unique_name):
    limits = limits_for(unique_name)
    admission = await admit_one(limiter, limits, T0, "r", 10, 20)
    assert admission.allowed and admission.headers() == {}
    usage = await limiter.usage(limits, now=T0)
    assert (usage["tokens_today"], usage["tokens_this_month"], usage["concurrency"]) == (30, 30, 1)


# --- tokens per minute: reservation and refund ----------------------------------------------------


async def test_tokens_are_reserved_then_refunded(limiter, unique_name):
    limits = limits_for(unique_name, tpm=1000)
    first = await admit_one(limiter, limits, T0 + 20, "a", prompt_tokens=100, max_tokens=500)
    assert (first.allowed, first.reserved_tokens, first.remaining_tokens) == (True, 600, 400)
    assert first.headers()["x-ratelimit-reset-tokens"] == "40s"
    refused = await admit_one(limiter, limits, T0 + 20, "b", prompt_tokens=100, max_tokens=400)
    assert (refused.reason, refused.retry_after) == ("rate_limit_tokens", pytest.approx(40.0))
    await limiter.complete(limits, "a", reserved_tokens=600, used_tokens=150)  # refunds 450
    assert (await limiter.usage(limits, now=T0 + 21))["tokens_this_minute"] == 150
    again = await admit_one(limiter, limits, T0 + 21, "b", prompt_tokens=100, max_tokens=400)
    assert (again.allowed, again.remaining_tokens) == (True, 350)


async def test_next_minute_starts_empty(limiter, unique_name):
    limits = limits_for(unique_name, tpm=100)
    assert (await admit_one(limiter, limits, T0 + 59, "a", 100)).allowed
    assert not (await admit_one(limiter, limits, T0 + 59.9, "b", 1)).allowed
    assert (await admit_one(limiter, limits, T0 + 60, "c", 100)).allowed


async def test_refund_is_given_once_and_only_to_the_windows_of_the_reservation(
    limiter, unique_name
):
    limits = limits_for(unique_name, tpm=1000, daily_token_quota=10_000)
    await admit_one(limiter, limits, T0 + 30, "a", 100, 900)
    await admit_one(limiter, limits, T0 + 70, "b", 100, 100)  # next minute
    await limiter.complete(limits, "a", reserved_tokens=1000, used_tokens=200)
    await limiter.complete(limits, "a", reserved_tokens=1000, used_tokens=200)
    usage = await limiter.usage(limits, now=T0 + 71)
    assert usage["tokens_this_minute"] == 200  # b's minute does not get a's refund
    assert usage["tokens_today"] == 200 + 200


async def test_refusal_reserves_nothing(limiter, unique_name):
    limits = limits_for(
        unique_name, rpm=60, burst=3, tpm=1000, max_concurrency=5, daily_token_quota=50
    )
    refused = await admit_one(limiter, limits, T0, "big", 40, 20)
    assert refused.reason == "daily_quota"
    usage = await limiter.usage(limits, now=T0)
    assert usage["tokens_this_minute"] == usage["tokens_today"] == usage["concurrency"] == 0
    assert usage["requests_remaining"] == 4  # burst + 1: no request was spent


# --- daily and monthly quotas --------------------------------------------------------------------


async def test_daily_quota_refuses_until_next_utc_day(limiter, unique_name):
    limits = limits_for(unique_name, daily_token_quota=1000, monthly_token_quota=5000)
    for i in range(10):
        assert (await admit_one(limiter, limits, T0, f"r{i}", 50, 50)).allowed
    refused = await admit_one(limiter, limits, T0, "r10", 1, 0)
    assert (refused.reason, refused.code, refused.http_status) == (
        "daily_quota",
        "insufficient_quota",
        429,
    )
    assert refused.retry_after == pytest.approx(12 * 3600)
    tomorrow = T0 + 12 * 3600
    assert (await admit_one(limiter, limits, tomorrow, "r11", 50, 50)).allowed
    usage = await limiter.usage(limits, now=tomorrow)
    assert (usage["tokens_today"], usage["tokens_this_month"]) == (100, 1100)


async def test_monthly_quota_refuses_until_next_month(limiter, unique_name):
    limits = limits_for(unique_name, monthly_token_quota=300)
    march_31 = datetime(2025, 3, 31, 23, 0, tzinfo=timezone.utc).timestamp()
    assert (await admit_one(limiter, limits, T0, "a", 200)).allowed
    refused = await admit_one(limiter, limits, march_31, "b", 200)
    assert (refused.reason, refused.code) == ("monthly_quota", "insufficient_quota")
    assert refused.retry_after == pytest.approx(3600)
    assert (await admit_one(limiter, limits, march_31 + 3600, "c", 200)).allowed


async def test_month_boundaries_match_the_calendar(limiter, unique_name):
    limits = limits_for(unique_name, monthly_token_quota=0)
    rng = random.Random(11)
    samples = [datetime(2024, 2, 29, 23, 59, 59, tzinfo=timezone.utc)]
    samples += [
        datetime(2100, 2, 28, tzinfo=timezone.utc),
        datetime(1999, 12, 31, tzinfo=timezone.utc),
    ]
    samples += [
        datetime(1970, 1, 1, tzinfo=timezone.utc) + timedelta(days=rng.uniform(0, 80_000))
        for _ in range(40)
    ]
    for moment in samples:
        refused = await admit_one(limiter, limits, moment.timestamp(), "r", 1)
        assert refused.retry_after == pytest.approx(seconds_to_next_month(moment), abs=1e-3)


def seconds_to_next_month(moment: datetime) -> float:
    year, month = (moment.year + 1, 1) if moment.month == 12 else (moment.year, moment.month + 1)
    return (datetime(year, month, 1, tzinfo=timezone.utc) - moment).total_seconds()


@pytest.mark.parametrize("quota_field", ["daily_token_quota", "monthly_token_quota"])
async def test_quota_never_overshot_by_200_concurrent_admits(limiter, unique_name, quota_field):
    quota, cost = 1003, 7
    limits = limits_for(unique_name, **{quota_field: quota})
    admissions = await asyncio.gather(
        *(limiter.admit(limits, f"r{i}", 3, 4) for i in range(200))  # server time
    )
    assert sum(a.reserved_tokens for a in admissions if a.allowed) == (quota // cost) * cost
    assert sum(a.allowed for a in admissions) == quota // cost
    assert all(not a.degraded for a in admissions)


# --- concurrency leases --------------------------------------------------------------------------


async def test_lease_released_on_complete(limiter, unique_name):
    limits = limits_for(unique_name, max_concurrency=2)
    assert (await admit_one(limiter, limits, T0, "a")).allowed
    assert (await admit_one(limiter, limits, T0, "b")).allowed
    refused = await admit_one(limiter, limits, T0, "c")
    assert (refused.reason, refused.code) == ("concurrency", "rate_limit_exceeded")
    assert refused.retry_after > 0
    await limiter.complete(limits, "a", reserved_tokens=1, used_tokens=1)
    assert (await admit_one(limiter, limits, T0, "c")).allowed


async def test_leases_expire_unless_renewed(limiter, unique_name):
    limits = limits_for(unique_name, max_concurrency=2)  # limiter's lease ttl: 30 s
    await admit_one(limiter, limits, T0, "dies")
    await admit_one(limiter, limits, T0, "lives")
    assert await limiter.renew(limits, "lives", now=T0 + 20)
    assert not (await admit_one(limiter, limits, T0 + 29, "x")).allowed
    assert (await admit_one(limiter, limits, T0 + 31, "y")).allowed  # "dies" expired
    assert not (await admit_one(limiter, limits, T0 + 31, "z")).allowed  # "lives" still holds
    assert not await limiter.renew(limits, "dies", now=T0 + 31)
    assert (await limiter.usage(limits, now=T0 + 31))["concurrency"] == 2
