"""The rate limiter when Redis is unreachable, slow, restarted (scripts flushed), and back."""

from __future__ import annotations

import asyncio
import socket
import time
from contextlib import suppress
from urllib.parse import urlparse

import pytest

from gateway.redis_client import make_redis
from gateway.tenancy.ratelimit import RateLimiter, TenantLimits


def closed_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class TcpProxy:
    """Forwards a local port to Redis: `stop()` is an outage, `start()` again the recovery;
    `late_script_replies` script calls (EVALSHA) get their replies `reply_delay_s` late."""

    def __init__(self, target_url: str) -> None:
        target = urlparse(target_url)
        self.target = (target.hostname, target.port or 6379)
        self.port = 0
        self.server: asyncio.Server | None = None
        self.writers: set[asyncio.StreamWriter] = set()
        self.tasks: set[asyncio.Task] = set()
        self.late_script_replies = 0
        self.reply_delay_s = 0.0
        self.script_calls = 0

    async def start(self) -> None:
        self.server = await asyncio.start_server(self._forward, "127.0.0.1", self.port)
        self.port = self.server.sockets[0].getsockname()[1]

    async def stop(self) -> None:
        self.server.close()
        await self.server.wait_closed()
        for writer in list(self.writers):
            writer.close()
        await asyncio.gather(*self.tasks, return_exceptions=True)

    async def _forward(self, client_reader, client_writer) -> None:
        self.tasks.add(asyncio.current_task())
        upstream_reader, upstream_writer = await asyncio.open_connection(*self.target)
        self.writers |= {client_writer, upstream_writer}
        late = asyncio.Queue()  # one entry per script call whose reply is to be late
        await asyncio.gather(
            pipe(client_reader, upstream_writer, lambda data: self._count_scripts(data, late)),
            pipe(upstream_reader, client_writer, lambda data: self._delay_reply(late)),
        )
        self.writers -= {client_writer, upstream_writer}

    async def _count_scripts(self, data: bytes, late: asyncio.Queue) -> None:
        calls = data.upper().count(b"EVALSHA")
        self.script_calls += calls
        for _ in range(min(calls, self.late_script_replies)):
            self.late_script_replies -= 1
            late.put_nowait(self.reply_delay_s)

    async def _delay_reply(self, late: asyncio.Queue) -> None:
        if not late.empty():
            await asyncio.sleep(late.get_nowait())


async def pipe(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, before=None) -> None:
    """Copy until the end; `before(data)` is awaited before each chunk is written."""
    with suppress(ConnectionError):
        while data := await reader.read(65536):
            if before is not None:
                await before(data)
            writer.write(data)
            await writer.drain()
    writer.close()
    with suppress(ConnectionError):
        await writer.wait_closed()


class SilentServer:
    """Accepts connections and never answers: a Redis that hangs."""

    def __init__(self) -> None:
        self.server: asyncio.Server | None = None
        self.tasks: set[asyncio.Task] = set()

    async def __aenter__(self) -> str:
        self.server = await asyncio.start_server(self._swallow, "127.0.0.1", 0)
        return f"redis://127.0.0.1:{self.server.sockets[0].getsockname()[1]}/0"

    async def __aexit__(self, *exc_info) -> None:
        self.server.close()
        await self.server.wait_closed()
        await asyncio.gather(*self.tasks, return_exceptions=True)

    async def _swallow(self, reader, writer) -> None:
        self.tasks.add(asyncio.current_task())
        while await reader.read(65536):
            pass
        writer.close()


@pytest.fixture
def limits(unique_name) -> TenantLimits:
    return TenantLimits(
        unique_name, rpm=600, tpm=10_000, max_concurrency=4, daily_token_quota=10**6
    )


@pytest.fixture
async def unreachable_redis():
    client = make_redis(f"redis://127.0.0.1:{closed_port()}/0")
    yield client
    await client.aclose()


async def test_open_admits_degraded_when_redis_is_unreachable(unreachable_redis, limits):
    limiter = RateLimiter(unreachable_redis, on_error="open")
    admission = await limiter.admit(limits, "r1", 10, 10)
    assert (admission.allowed, admission.degraded, admission.reason) == (True, True, None)
    assert admission.headers() == {}
    await limiter.complete(limits, "r1", 20, 5)
    assert not await limiter.renew(limits, "r1")
    assert (await limiter.usage(limits))["available"] is False


async def test_closed_refuses_with_503_when_redis_is_unreachable(unreachable_redis, limits):
    limiter = RateLimiter(unreachable_redis, on_error="closed")
    admission = await limiter.admit(limits, "r1", 10, 10)
    assert (admission.allowed, admission.reason, admission.http_status) == (
        False,
        "unavailable",
        503,
    )
    assert admission.retry_after > 0 and admission.headers() == {"Retry-After": "1"}


async def test_a_hung_redis_costs_one_timeout_per_retry_interval(limits):
    async with SilentServer() as url:
        client = make_redis(url, socket_timeout_s=0.1, connect_timeout_s=0.1)
        limiter = RateLimiter(client, on_error="open", retry_interval_s=30)
        started = time.monotonic()
        first = await limiter.admit(limits, "r1", 1, 1)
        first_s = time.monotonic() - started
        later = [await limiter.admit(limits, f"r{i}", 1, 1) for i in range(2, 20)]
        later_s = time.monotonic() - started - first_s
        await client.aclose()
    assert first.degraded and all(a.degraded for a in later)
    assert 0.1 <= first_s < 1.0
    assert later_s < 0.05


@pytest.mark.parametrize("on_error", ["open", "closed"])
async def test_recovers_when_redis_comes_back_with_its_scripts_gone(redis_url, limits, on_error):
    proxy = TcpProxy(redis_url)
    await proxy.start()
    client = make_redis(f"redis://127.0.0.1:{proxy.port}/0")
    admin = make_redis(redis_url)
    limiter = RateLimiter(client, on_error=on_error, retry_interval_s=0.05)
    try:
        assert await limiter.load_scripts()
        healthy = await limiter.admit(limits, "before", 1, 1)
        await proxy.stop()
        during = await limiter.admit(limits, "during", 1, 1)
        await admin.script_flush()  # a restarted Redis has forgotten every script
        await proxy.start()
        await asyncio.sleep(0.06)
        after = await limiter.admit(limits, "after", 1, 1)
    finally:
        await client.aclose()
        await admin.delete(*[key async for key in admin.scan_iter(match=f"*{limits.tenant}*")])
        await admin.aclose()
        await proxy.stop()
    assert healthy.allowed and not healthy.degraded
    assert during.degraded and during.allowed == (on_error == "open")
    assert after.allowed and not after.degraded and after.remaining_requests == 600 - 2


@pytest.mark.parametrize("backend", ["fakeredis", "redis"])
async def test_script_flush_is_survived(redis_url, limits, backend):
    client = make_redis(None if backend == "fakeredis" else redis_url)
    limiter = RateLimiter(client, on_error="closed")
    try:
        assert (await limiter.admit(limits, "r1", 1, 1)).allowed
        await client.script_flush()
        admission = await limiter.admit(limits, "r2", 1, 1)
        await client.script_flush()
        await limiter.complete(limits, "r2", 2, 1)
        await client.script_flush()
        usage = await limiter.usage(limits)
    finally:
        await client.delete(*[key async for key in client.scan_iter(match=f"*{limits.tenant}*")])
        await client.aclose()
    assert admission.allowed and not admission.degraded
    assert usage["available"] and usage["tokens_today"] == 3 and usage["concurrency"] == 1


async def test_a_reply_lost_to_a_timeout_admits_the_request_once(redis_url, unique_name):
    """The connection resends a command whose reply timed out, so Redis runs the admission twice
    for one request; at the limit the second run used to refuse the request its first run had
    admitted (and charged it twice): replicas under load gave fewer than rpm requests."""
    limits = TenantLimits(unique_name, rpm=2, daily_token_quota=1000)
    proxy = TcpProxy(redis_url)
    await proxy.start()
    client = make_redis(f"redis://127.0.0.1:{proxy.port}/0", socket_timeout_s=0.1)
    limiter = RateLimiter(client, on_error="closed")
    try:
        assert await limiter.load_scripts()
        assert (await limiter.admit(limits, "a", 1, 1)).allowed
        calls_before = proxy.script_calls
        proxy.late_script_replies, proxy.reply_delay_s = 1, 0.3
        resent = await limiter.admit(limits, "b", 1, 1)
        calls = proxy.script_calls - calls_before
        usage = await limiter.usage(limits)
    finally:
        await client.aclose()
        await proxy.stop()
        admin = make_redis(redis_url)
        await admin.delete(*[key async for key in admin.scan_iter(match=f"*{unique_name}*")])
        await admin.aclose()
    assert calls == 2  # the late reply was given up on and the script sent again
    assert (resent.allowed, resent.degraded, resent.remaining_requests) == (True, False, 0)
    assert (usage["tokens_today"], usage["requests_remaining"], usage["concurrency"]) == (4, 0, 2)
