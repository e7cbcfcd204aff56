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
    return RateLimiter(redis_client, lease_ttl_s=30)


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
    names = [keys.requests, *keys.tokens, keys.tokens_day, keys.tokens_month, keys.leases]
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
    assert len(written) == 8  # requests, tokens (3), day, month, leases, reservation of r2
    assert all(f"{{{unique_name}}}".encode() in key for key in written)
    assert len({key_slot(key) for key in written}) == 1


# --- requests per minute (sliding window) ----------------------------------------------------


async def test_rpm_4_admits_4_of_7_sent_at_once(limiter, unique_name):
    limits = limits_for(unique_name, rpm=4)
    admissions = [await admit_one(limiter, limits, T0, f"r{i}") for i in range(7)]
    assert [a.allowed for a in admissions] == [True] * 4 + [False] * 3
    assert [a.remaining_requests for a in admissions[:4]] == [3, 2, 1, 0]
    refused = admissions[4]
    assert (refused.reason, refused.code, refused.error_type) == (
        "rate_limit_requests",
        "rate_limit_exceeded",
        "requests",
    )
    assert refused.retry_after == pytest.approx(60.0)
    assert refused.headers()["Retry-After"] == "60"


async def test_all_n_at_the_top_of_a_window_then_all_n_in_the_next(limiter, unique_name):
    rpm = 20
    limits = limits_for(unique_name, rpm=rpm)
    for minute in range(3):
        start = T0 + 60 * minute
        admitted = [await admit_one(limiter, limits, start, f"m{minute}-{i}") for i in range(rpm)]
        assert all(a.allowed for a in admitted)
        late = await admit_one(limiter, limits, start + 59.999, f"m{minute}-late")
        assert not late.allowed and late.retry_after == pytest.approx(0.001, abs=1e-3)


async def test_evenly_spaced_at_the_limit_is_never_refused(limiter, unique_name):
    rpm = 6  # one every 10 s, for five minutes; then a seventh in a minute is refused
    limits = limits_for(unique_name, rpm=rpm)
    arrivals = [T0 + 10 * i for i in range(30)]
    assert await admitted_times(limiter, limits, arrivals) == arrivals
    assert not (await admit_one(limiter, limits, arrivals[-1] + 5, "extra")).allowed


async def test_burst_is_extra_on_top_of_rpm(limiter, unique_name):
    limits = limits_for(unique_name, rpm=60, burst=4)
    admitted = [await admit_one(limiter, limits, T0 + i / 100, f"r{i}") for i in range(64)]
    assert all(a.allowed for a in admitted)
    refused = await admit_one(limiter, limits, T0 + 1, "r64")
    assert refused.reason == "rate_limit_requests"
    assert refused.retry_after == pytest.approx(59.0)  # until the first of the 64 leaves


async def test_refused_client_is_admitted_after_retry_after(limiter, unique_name):
    limits = limits_for(unique_name, rpm=2)
    assert (await admit_one(limiter, limits, T0, "a")).allowed
    assert (await admit_one(limiter, limits, T0 + 30, "b")).allowed
    refused = await admit_one(limiter, limits, T0 + 40, "c")
    assert refused.retry_after == pytest.approx(20.0)
    assert not (await admit_one(limiter, limits, T0 + 59.9, "d")).allowed
    assert (await admit_one(limiter, limits, T0 + 40 + refused.retry_after, "e")).allowed


async def test_request_headers_count_what_is_still_admissible(limiter, unique_name):
    limits = limits_for(unique_name, rpm=600)
    first = await admit_one(limiter, limits, T0, "r0")
    headers = first.headers()
    assert headers["x-ratelimit-limit-requests"] == "600"
    assert headers["x-ratelimit-remaining-requests"] == "599"
    assert headers["x-ratelimit-reset-requests"] == "0s"  # one more is admissible now
    for i in range(1, 600):
        last = await admit_one(limiter, limits, T0 + i / 100, f"r{i}")
    assert last.allowed and last.headers()["x-ratelimit-remaining-requests"] == "0"
    assert last.headers()["x-ratelimit-reset-requests"] == format_reset(60 - 5.99)


async def test_never_more_than_rpm_plus_burst_in_any_60_s(limiter, unique_name):
    rpm, burst = 30, 5
    steady = limits_for(unique_name + "-steady", rpm=rpm, burst=burst)
    every_quarter_second = [T0 + i / 4 for i in range(4 * 150)]
    admitted = await admitted_times(limiter, steady, every_quarter_second)
    assert most_in_one_minute(admitted) == rpm + burst
    jittery = limits_for(unique_name + "-jittery", rpm=rpm, burst=burst)
    random_times = sorted(T0 + random.Random(7).uniform(0, 150) for _ in range(300))
    admitted = await admitted_times(limiter, jittery, random_times)
    assert most_in_one_minute(admitted) == rpm + burst


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
    assert first.headers()["x-ratelimit-reset-tokens"] == "0s"  # a token is admissible now
    refused = await admit_one(limiter, limits, T0 + 20, "b", prompt_tokens=100, max_tokens=400)
    assert (refused.reason, refused.error_type) == ("rate_limit_tokens", "tokens")
    assert refused.retry_after == pytest.approx(60.0)  # until "a" leaves the window
    await limiter.complete(limits, "a", reserved_tokens=600, used_tokens=150)  # refunds 450
    assert (await limiter.usage(limits, now=T0 + 21))["tokens_this_minute"] == 150
    again = await admit_one(limiter, limits, T0 + 21, "b", prompt_tokens=100, max_tokens=400)
    assert (again.allowed, again.remaining_tokens) == (True, 350)


async def test_tokens_all_at_the_top_of_a_window_then_the_next(limiter, unique_name):
    limits = limits_for(unique_name, tpm=100)
    assert (await admit_one(limiter, limits, T0, "a", 100)).allowed
    refused = await admit_one(limiter, limits, T0 + 59.9, "b", 1)
    assert not refused.allowed and refused.retry_after == pytest.approx(0.1)
    assert refused.headers()["x-ratelimit-remaining-tokens"] == "0"
    assert (await admit_one(limiter, limits, T0 + 60, "c", 100)).allowed


async def test_tokens_never_exceed_tpm_in_any_60_s(limiter, unique_name):
    limits = limits_for(unique_name, tpm=1000)
    rng = random.Random(3)
    arrivals = sorted((T0 + rng.uniform(0, 180), rng.randint(1, 300)) for _ in range(200))
    admitted = []
    for i, (t, cost) in enumerate(arrivals):
        if (await admit_one(limiter, limits, t, f"r{i}", cost)).allowed:
            admitted.append((t, cost))
    most = max(sum(c for u, c in admitted if t <= u < t + 60) for t, _ in admitted)
    assert 900 < most <= 1000


async def test_refund_is_given_once_and_only_while_in_the_window(limiter, unique_name):
    limits = limits_for(unique_name, tpm=1000, daily_token_quota=10_000)
    await admit_one(limiter, limits, T0 + 30, "a", 100, 900)
    assert not (await admit_one(limiter, limits, T0 + 70, "b", 100, 100)).allowed
    assert (await admit_one(limiter, limits, T0 + 91, "b", 100, 100)).allowed  # "a" has left
    await limiter.complete(limits, "a", reserved_tokens=1000, used_tokens=200)
    await limiter.complete(limits, "a", reserved_tokens=1000, used_tokens=200)
    usage = await limiter.usage(limits, now=T0 + 92)
    assert usage["tokens_this_minute"] == 200  # b's window does not get a's refund
    assert usage["tokens_today"] == 200 + 200


async def test_refusal_reserves_nothing(limiter, unique_name):
    limits = limits_for(
        unique_name, rpm=60, burst=3, tpm=1000, max_concurrency=5, daily_token_quota=50
    )
    refused = await admit_one(limiter, limits, T0, "big", 40, 20)
    assert refused.reason == "daily_quota"
    usage = await limiter.usage(limits, now=T0)
    assert usage["tokens_this_minute"] == usage["tokens_today"] == usage["concurrency"] == 0
    assert usage["requests_remaining"] == 63  # rpm + burst: no request was spent


async def test_an_admission_run_twice_admits_and_charges_once(limiter, unique_name):
    """The connection resends a command whose reply timed out, so the script can run twice for
    one request: the second run finds the request counted and charges nothing more."""
    limits = limits_for(unique_name, rpm=2, tpm=1000, daily_token_quota=1000)
    assert (await admit_one(limiter, limits, T0, "a", 10, 20)).allowed
    assert (await admit_one(limiter, limits, T0, "b", 10, 20)).allowed
    again = await admit_one(limiter, limits, T0 + 0.5, "b", 10, 20)  # b fills the window itself
    assert (again.allowed, again.remaining_requests, again.remaining_tokens) == (True, 0, 940)
    usage = await limiter.usage(limits, now=T0 + 1)
    assert (usage["tokens_today"], usage["tokens_this_minute"], usage["concurrency"]) == (60, 60, 2)
    assert not (await admit_one(limiter, limits, T0 + 1, "c", 10, 20)).allowed


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
