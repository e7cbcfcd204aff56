"""A change to any key or tenant, pushed to every replica: one counter in Redis, bumped after
each change commits and read by every replica before it trusts its authentication cache.

A replica whose counter differs from the one it last saw forgets its cached answers, so a key
revoked (expired, narrowed, its tenant disabled) on one replica is refused by every other
replica from their next request on, whatever their caches hold. While Redis is unreachable the
caches fall back to their lifetime (`Authenticator.ttl_s`).
"""

from __future__ import annotations

import asyncio
import logging
import time

import redis.asyncio as aioredis

from gateway.tenancy.ratelimit import REDIS_ERRORS

log = logging.getLogger(__name__)


KEY_CHANGES = "conveyor:keys:version"


READ_TIMEOUT_S = 0.5


RETRY_INTERVAL_S = 1.0


class KeyChanges:
    """The shared change counter; `None` from `version` means "unknown" (Redis unreachable)."""

    def __init__(self, redis: aioredis.Redis, name: str = KEY_CHANGES) -> None:
        self.redis = redis
        self.name = name
        self._skip_until = 0.0

    async def version(self) -> int | None:
        if time.monotonic() < self._skip_until:
            return None
        try:
            value = await asyncio.wait_for(self.redis.get(self.name), READ_TIMEOUT_S)
        except REDIS_ERRORS as error:
            self._skip_until = time.monotonic() + RETRY_INTERVAL_S
            log.warning("key changes: Redis unavailable (%s)", type(error).__name__)
            return None
        return int(value or 0)

    async def bump(self) -> bool:
        """Tell every replica that keys changed; False if Redis could not be told."""
        try:
            await asyncio.wait_for(self.redis.incr(self.name), READ_TIMEOUT_S)
        except REDIS_ERRORS:
            log.warning("key changes: could not tell the other replicas", exc_info=True)
            return False
        return True
