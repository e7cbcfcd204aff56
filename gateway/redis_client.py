"""Redis connections: a real server from a URL, or an in-process fakeredis for the embedded mode.

Both speak the same protocol and run the same Lua scripts (fakeredis through lupa), so the rate
limiter never needs to know which one it got.
"""

from __future__ import annotations

import fakeredis
import redis.asyncio as aioredis
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff

# Short timeouts: an outage must be noticed within a fraction of a request's latency budget.
SOCKET_TIMEOUT_S = 0.5
CONNECT_TIMEOUT_S = 0.5
# Connections are shared by every in-flight request of a replica; when all are busy a request
# waits this long for one instead of failing at once.
MAX_CONNECTIONS = 64
POOL_WAIT_S = 1.0
# One immediate retry replaces a pooled connection that died (e.g. Redis restarted); more
# retries would only delay the on-error decision while Redis is really gone.
NUM_RETRIES = 1


def make_redis(
    url: str | None,
    *,
    socket_timeout_s: float = SOCKET_TIMEOUT_S,
    connect_timeout_s: float = CONNECT_TIMEOUT_S,
) -> aioredis.Redis:
    """`redis://host:port/db` or `rediss://…` → a real client; None → in-process fakeredis.

    The caller owns the client and must `await client.aclose()`.
    """
    if url is None:
        return make_embedded_redis()
    pool = aioredis.BlockingConnectionPool.from_url(
        url,
        max_connections=MAX_CONNECTIONS,
        timeout=POOL_WAIT_S,
        socket_timeout=socket_timeout_s,
        socket_connect_timeout=connect_timeout_s,
        retry=Retry(NoBackoff(), NUM_RETRIES),
    )
    return aioredis.Redis.from_pool(pool)


def make_embedded_redis() -> aioredis.Redis:
    """A fresh in-process server (its own keyspace) with Lua scripting."""
    return fakeredis.FakeAsyncRedis(
        server=fakeredis.FakeServer(),
        version=(7,),
        connection_pool_class=aioredis.BlockingConnectionPool,
        max_connections=MAX_CONNECTIONS,
    )
