"""Every typed key stored on the application or on a request, in one place."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from aiohttp import web

if TYPE_CHECKING:
    import redis.asyncio as aioredis
    from sqlalchemy.ext.asyncio import AsyncEngine as SqlEngine
    from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker

    from gateway.metrics import Metrics
    from gateway.settings import ServeSettings
    from gateway.tenancy.ratelimit import RateLimiter
    from runtime.engine_client import EngineClient


@dataclass
class ServingState:
    """Mutable facts of this replica that handlers share."""

    num_inflight_sequences: int = 0  # submitted to the engine and not yet finished
    is_draining: bool = False  # shutting down: refuse new work, finish what runs
    inflight: dict[str, Any] = field(default_factory=dict)  # HTTP request id -> its Tracker


@dataclass(frozen=True)
class Principal:
    """Who is calling: the tenant (row or snapshot with the tenant fields) and its key's id."""

    tenant: Any
    key_id: int | None = None
    key: Any = None  # the key's scopes and limits (gateway.tenancy.key_models.ApiKeyOut)


# ---- application --------------------------------------------------------------------------
SETTINGS: web.AppKey[ServeSettings] = web.AppKey("settings")
ENGINE_CLIENT: web.AppKey[EngineClient] = web.AppKey("engine_client")
SERVING_STATE: web.AppKey[ServingState] = web.AppKey("serving_state")
REDIS: web.AppKey[aioredis.Redis] = web.AppKey("redis")
RATE_LIMITER: web.AppKey[RateLimiter] = web.AppKey("rate_limiter")
DATABASE: web.AppKey[SqlEngine] = web.AppKey("database")
SESSIONMAKER: web.AppKey[async_sessionmaker[AsyncSession]] = web.AppKey("sessionmaker")
AUTHENTICATOR: web.AppKey[Any] = web.AppKey("authenticator")
AUDIT: web.AppKey[Any] = web.AppKey("audit_writer")  # None when audit is off (--no-audit)
METRICS: web.AppKey[Metrics] = web.AppKey("metrics")

# ---- request ------------------------------------------------------------------------------
REQUEST_ID: web.RequestKey[str] = web.RequestKey("request_id")
PRINCIPAL: web.RequestKey[Principal] = web.RequestKey("principal")
# (wall clock, monotonic clock) when the handler started; audit times are measured from it
RECEIVED: web.RequestKey[tuple[float, float]] = web.RequestKey("received")
