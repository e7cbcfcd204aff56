"""API keys: creation, listing and revocation, keyed hashing, and authentication with a short
cache.

API keys are shown once (`cvy_` + 40 url-safe characters) and stored only as an HMAC-SHA256 of
the key under a server secret, next to a short visible prefix.
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import logging
import re
import secrets
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime
from typing import NamedTuple

from sqlalchemy import select, update
from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker

from gateway.models import ApiKey, Tenant, utcnow
from gateway.tenancy.key_changes import KeyChanges
from gateway.tenancy.key_models import ApiKeyOut, KeyCreate, ended_at, stored_limits
from gateway.tenancy.tenants import TenantOut, load_tenant

log = logging.getLogger(__name__)


KEY_SCHEME = "cvy_"


KEY_SECRET_LEN = 40  # url-safe characters after the scheme


KEY_PREFIX_LEN = len(KEY_SCHEME) + 4


KEY_PATTERN = re.compile(rf"{KEY_SCHEME}[A-Za-z0-9_-]{{{KEY_SECRET_LEN}}}")


class ApiKeyNotFound(LookupError):
    pass


class KeyHasher:
    """HMAC-SHA256 of API keys under a server secret; hex digests, constant-time comparison."""

    def __init__(self, secret: str | bytes):
        if not secret:
            raise ValueError("the API key secret must not be empty")
        self._secret = secret.encode() if isinstance(secret, str) else secret

    def hash(self, plaintext: str) -> str:
        return hmac.new(self._secret, plaintext.encode(), hashlib.sha256).hexdigest()

    def verify(self, plaintext: str, key_hash: str) -> bool:
        return hmac.compare_digest(self.hash(plaintext), key_hash)


def new_plaintext_key() -> str:
    return KEY_SCHEME + secrets.token_urlsafe(KEY_SECRET_LEN * 3 // 4)


def looks_like_key(plaintext: str) -> bool:
    return KEY_PATTERN.fullmatch(plaintext) is not None


async def create_key(
    session: AsyncSession, tenant_id: int, hasher: KeyHasher, spec: KeyCreate | None = None
) -> tuple[ApiKey, str]:
    """A new key for the tenant: the stored row and the plaintext, which is never stored.

    `spec`: its name, expiry (`expires_at` or `duration`), scopes and limits (ValueError when
    both expiry forms are given)."""
    await load_tenant(session, tenant_id)
    spec = spec or KeyCreate()
    plaintext = new_plaintext_key()
    key = ApiKey(
        tenant_id=tenant_id,
        prefix=plaintext[:KEY_PREFIX_LEN],
        key_hash=hasher.hash(plaintext),
        name=spec.name,
        expires_at=spec.expiry(utcnow()),
        models=spec.models,
        endpoints=spec.endpoints,
        limits=stored_limits(spec.limits),
    )
    session.add(key)
    await session.flush()
    return key, plaintext


async def list_keys(session: AsyncSession, tenant_id: int) -> list[ApiKey]:
    await load_tenant(session, tenant_id)
    keys = await session.scalars(
        select(ApiKey).where(ApiKey.tenant_id == tenant_id).order_by(ApiKey.id)
    )
    return list(keys)


async def revoke_key(session: AsyncSession, key_id: int) -> ApiKey:
    """Mark the key revoked (idempotent); every replica rejects it once its cache entry ends."""
    key = await session.get(ApiKey, key_id)
    if key is None:
        raise ApiKeyNotFound(f"no API key with id {key_id}")
    if key.revoked_at is None:
        key.revoked_at = utcnow()
        await session.flush()
    return key


class AuthResult(NamedTuple):
    tenant: TenantOut
    key: ApiKeyOut

    def ended_message(self, now: datetime) -> str | None:
        """Why the key no longer works (expired, or rotated and its grace over), else None."""
        end = ended_at(self.key)
        if end is None or now < end:
            return None
        when = end.isoformat(timespec="seconds")
        if self.key.grace_ends_at is not None and end == self.key.grace_ends_at:
            return f"This API key was rotated; its grace period ended at {when}."
        return f"This API key expired at {when}. Ask your administrator for a new one."


@dataclass(slots=True)
class _CacheEntry:
    expires_at: float  # ask the database again after this
    checked_at: float  # when the database last gave this answer
    result: AuthResult | None
    version: int | None = None  # the key-change counter when it was asked


class Authenticator:
    """Maps a bearer key to its tenant and key, or None when unknown, revoked or disabled. An
    expired or rotated key is returned as it is: `AuthResult.ended_message` says when it ended.

    Answers, found or not, are cached for at most `ttl_s`; with `changes` (the key-change counter
    in Redis) every answer cached before the last change anywhere is forgotten at the next call,
    so a revocation or a disabled tenant takes effect on every replica at once (within `ttl_s`
    while Redis is unreachable). Concurrent misses for one key share a
    single query. `last_used_at` is written in the background at most every `touch_interval_s`
    per key.

    While the database is unreachable, the last answer for a key keeps being used for up to
    `stale_for_s` after the database gave it (a key valid then keeps working, with the tenant's
    limits as last read), and the database is asked again at most every `ttl_s` per key, so a
    revocation applies as soon as it answers. A key with no answer that recent (one never seen,
    or `stale_for_s=0`) gets the database error (the caller answers 503).
    """

    def __init__(
        self,
        sessionmaker: async_sessionmaker[AsyncSession],
        hasher: KeyHasher,
        *,
        ttl_s: float = 2.0,
        stale_for_s: float = 0.0,
        touch_interval_s: float = 60.0,
        max_entries: int = 10_000,
        clock: Callable[[], float] = time.monotonic,
        changes: KeyChanges | None = None,
    ):
        self._sessionmaker = sessionmaker
        self._hasher = hasher
        self._ttl_s = ttl_s
        self._stale_for_s = stale_for_s
        self._touch_interval_s = touch_interval_s
        self._max_entries = max_entries
        self._clock = clock
        self._cache: OrderedDict[str, _CacheEntry] = OrderedDict()
        self._lookups: dict[str, asyncio.Task[AuthResult | None]] = {}
        self._last_touched: dict[int, float] = {}
        self._touches: set[asyncio.Task[None]] = set()
        self._changes = changes
        self._version: int | None = None  # the change counter last read

    async def authenticate(self, plaintext: str) -> AuthResult | None:
        if not looks_like_key(plaintext):
            return None
        key_hash = self._hasher.hash(plaintext)
        await self._forget_if_changed()
        result = await self._cached_or_lookup(key_hash)
        if result is not None:
            self._touch_if_due(result.key)
        return result

    def invalidate(self) -> None:
        """Forget every cached answer (this replica only)."""
        self._cache.clear()

    async def announce_change(self) -> None:
        """A key or tenant changed (committed): forget here, and tell every other replica."""
        self.invalidate()
        if self._changes is not None:
            await self._changes.bump()

    async def _forget_if_changed(self) -> None:
        if self._changes is None:
            return
        version = await self._changes.version()
        if version is not None and version != self._version:
            self._version = version
            self._cache.clear()

    async def close(self) -> None:
        """Wait for pending `last_used_at` writes."""
        if self._touches:
            await asyncio.gather(*self._touches, return_exceptions=True)

    async def _cached_or_lookup(self, key_hash: str) -> AuthResult | None:
        entry = self._cache.get(key_hash)
        is_current = entry is not None and entry.version == self._version
        if is_current and entry.expires_at > self._clock():
            return entry.result
        lookup = self._lookups.get(key_hash)
        if lookup is None:
            lookup = asyncio.ensure_future(self._lookup_and_cache(key_hash))
            self._lookups[key_hash] = lookup
            lookup.add_done_callback(lambda _: self._lookups.pop(key_hash, None))
        return await asyncio.shield(lookup)

    async def _lookup_and_cache(self, key_hash: str) -> AuthResult | None:
        version = self._version  # an answer read before a later change is not kept past it
        try:
            result = await self._lookup(key_hash)
        except Exception as error:
            return self._stale_answer_or_raise(key_hash, error)
        self._remember(key_hash, result, version)
        return result

    def _stale_answer_or_raise(self, key_hash: str, error: Exception) -> AuthResult | None:
        """The database failed: the last answer if it is recent enough, else re-raise."""
        entry = self._cache.get(key_hash)
        now = self._clock()
        if entry is None or now - entry.checked_at > self._stale_for_s:
            raise error
        log.warning("database unreachable: using the answer for a key from %.1f s ago",
                    now - entry.checked_at)  # fmt: skip
        entry.expires_at = now + self._ttl_s  # ask again after ttl_s, not on every request
        entry.version = self._version
        return entry.result

    async def _lookup(self, key_hash: str) -> AuthResult | None:
        query = (
            select(ApiKey, Tenant)
            .join(Tenant, Tenant.id == ApiKey.tenant_id)
            .where(ApiKey.key_hash == key_hash)
        )
        async with self._sessionmaker() as session:
            row = (await session.execute(query)).first()
        if row is None:
            return None
        key, tenant = row
        usable = key.revoked_at is None and tenant.enabled
        if not usable or not hmac.compare_digest(key.key_hash, key_hash):
            return None
        return AuthResult(TenantOut.model_validate(tenant), ApiKeyOut.model_validate(key))

    def _remember(self, key_hash: str, result: AuthResult | None, version: int | None) -> None:
        now = self._clock()
        self._cache[key_hash] = _CacheEntry(now + self._ttl_s, now, result, version)
        self._cache.move_to_end(key_hash)
        while len(self._cache) > self._max_entries:
            self._cache.popitem(last=False)

    def _touch_if_due(self, key: ApiKeyOut) -> None:
        now = self._clock()
        last = self._last_touched.get(key.id)
        if last is None and key.last_used_at is not None:
            age_s = (utcnow() - key.last_used_at).total_seconds()
            last = now - max(age_s, 0.0)
        if last is not None and now - last < self._touch_interval_s:
            return
        self._last_touched[key.id] = now
        task = asyncio.ensure_future(self._write_last_used(key.id))
        self._touches.add(task)
        task.add_done_callback(self._touches.discard)

    async def _write_last_used(self, key_id: int) -> None:
        try:
            async with self._sessionmaker.begin() as session:
                statement = update(ApiKey).where(ApiKey.id == key_id)
                await session.execute(statement.values(last_used_at=utcnow()))
        except Exception:  # best effort: never fails a request
            log.warning("could not record last use of API key %s", key_id, exc_info=True)
