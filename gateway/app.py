"""The aiohttp application factory: one `cleanup_ctx` per resource, middleware factories, the
OpenAI routes, health probes and the admin sub-app.

Startup order: database (migrated), Redis and the rate limiter, audit writer, authenticator,
demo tenant on a first start, then the model (loaded on a thread). Shutdown runs in reverse,
after `gateway.lifecycle` has drained in-flight requests for up to `--drain-timeout` seconds.
"""

from __future__ import annotations

import asyncio
import logging
import shlex
import sys
from collections.abc import AsyncIterator
from pathlib import Path

from aiohttp import web

from gateway import lifecycle, metrics_routes
from gateway.admin import routes as admin
from gateway.appkeys import (
    AUDIT,
    AUTHENTICATOR,
    DATABASE,
    ENGINE_CLIENT,
    PRINCIPAL,
    RATE_LIMITER,
    REDIS,
    SERVING_STATE,
    SESSIONMAKER,
    SETTINGS,
    Principal,
    ServingState,
)
from gateway.audit import retention
from gateway.errors import (
    HANDLER_ARGS,
    APIError,
    add_request_id_header,
    error_middleware,
    invalid_api_key,
    missing_api_key,
    overloaded,
    request_id_middleware,
)
from gateway.models import utcnow
from gateway.openai import routes as openai_routes
from gateway.pages import auth as page_auth
from gateway.pages import routes as pages
from gateway.settings import ServeSettings
from gateway.tenancy.scopes import check_endpoint

log = logging.getLogger(__name__)

AUTHENTICATED_PREFIX = "/v1/"
DEMO_TENANT_NAME = "demo"
REDIS_PING_TIMEOUT_S = 1.0


def create_app(settings: ServeSettings) -> web.Application:
    app = web.Application(
        client_max_size=settings.max_body_bytes,
        handler_args=HANDLER_ARGS,
        middlewares=[request_id_middleware(), error_middleware(), auth_middleware()],
    )
    app[SETTINGS] = settings
    app[SERVING_STATE] = ServingState()
    app.cleanup_ctx.extend(
        [database_ctx, redis_ctx, audit_ctx, authenticator_ctx, demo_tenant_ctx, engine_ctx]
    )
    app.cleanup_ctx.append(retention.audit_retention_ctx)
    metrics_routes.install(app)  # app[METRICS], GET /metrics and the step-rate sampler
    app.on_response_prepare.append(add_request_id_header)
    app.on_response_prepare.append(lifecycle.close_connection_while_draining)
    app.on_shutdown.append(start_draining)
    app.router.add_get("/healthz", healthz)
    app.router.add_get("/readyz", readyz)
    openai_routes.add_routes(app.router)
    pages.add_tenant_routes(app.router)  # /v1/requests/{id}/timeline, /pages/static/
    app.add_subapp("/admin", admin.create_admin_app())
    return app


# ---- resources --------------------------------------------------------------------------------
async def database_ctx(app: web.Application) -> AsyncIterator[None]:
    from gateway.db import make_async_engine, make_sessionmaker, upgrade

    url = app[SETTINGS].database_url
    if app[SETTINGS].auto_migrate:
        await asyncio.to_thread(upgrade, url)
    engine = make_async_engine(url)
    app[DATABASE] = engine
    app[SESSIONMAKER] = make_sessionmaker(engine)
    yield
    await engine.dispose()


async def redis_ctx(app: web.Application) -> AsyncIterator[None]:
    from gateway.redis_client import make_redis
    from gateway.tenancy.ratelimit import RateLimiter

    settings = app[SETTINGS]
    redis = make_redis(settings.redis_url)
    app[REDIS] = redis
    app[RATE_LIMITER] = RateLimiter(redis, on_error=settings.rate_limit_on_error)
    if not await app[RATE_LIMITER].load_scripts():
        log.warning(
            "Redis is unreachable at startup; rate limits are %s",
            "fail-" + settings.rate_limit_on_error,
        )
    yield
    await redis.aclose()


async def audit_ctx(app: web.Application) -> AsyncIterator[None]:
    from gateway.audit.writer import AuditWriter

    if not app[SETTINGS].audit:  # --no-audit: nothing is recorded (benchmarks compare)
        app[AUDIT] = None
        yield
        return
    writer = AuditWriter(app[DATABASE], Path(app[SETTINGS].audit_spool_path))
    writer.start()
    app[AUDIT] = writer
    yield
    await writer.close()


async def authenticator_ctx(app: web.Application) -> AsyncIterator[None]:
    from gateway.tenancy.key_changes import KeyChanges
    from gateway.tenancy.keys import Authenticator, KeyHasher

    hasher = KeyHasher(app[SETTINGS].effective_key_hash_secret)
    stale_for_s = app[SETTINGS].auth_stale_for
    authenticator = Authenticator(
        app[SESSIONMAKER], hasher, stale_for_s=stale_for_s, changes=KeyChanges(app[REDIS])
    )
    app[AUTHENTICATOR] = authenticator
    yield
    await authenticator.close()


async def demo_tenant_ctx(app: web.Application) -> AsyncIterator[None]:
    if app[SETTINGS].create_demo_tenant:
        plaintext = await create_demo_tenant_if_none(app)
        if plaintext is not None:
            print_demo_instructions(app[SETTINGS], plaintext)
    yield


async def engine_ctx(app: web.Application) -> AsyncIterator[None]:
    from runtime.engine_client import EngineClient

    client = await EngineClient.launch(app[SETTINGS].engine_config())
    app[ENGINE_CLIENT] = client
    log.info(
        "model %s loaded: %d KV blocks",
        ", ".join(client.info.served_model_names),
        client.info.kv_capacity_tokens // client.info.block_size,
    )
    yield
    await asyncio.to_thread(client.stop)


async def start_draining(app: web.Application) -> None:
    """`on_shutdown`: refuse new work; aiohttp then waits for in-flight requests."""
    app[SERVING_STATE].is_draining = True


# ---- demo tenant -------------------------------------------------------------------------------
async def create_demo_tenant_if_none(app: web.Application) -> str | None:
    """On a first start (no tenants at all) create `demo` and return its key's plaintext."""
    from gateway.tenancy.keys import KeyHasher, create_key
    from gateway.tenancy.tenants import TenantCreate, TenantNameTaken, create_tenant, list_tenants

    hasher = KeyHasher(app[SETTINGS].effective_key_hash_secret)
    try:
        async with app[SESSIONMAKER].begin() as session:
            if await list_tenants(session):
                return None
            tenant = await create_tenant(session, TenantCreate(name=DEMO_TENANT_NAME))
            _, plaintext = await create_key(session, tenant.id, hasher)
    except TenantNameTaken:  # another replica's first start won
        return None
    return plaintext


def print_demo_instructions(settings: ServeSettings, plaintext: str) -> None:
    from runtime.models.loader import served_model_names

    model_name = served_model_names(settings.model, settings.served_model_name)[0]
    host = "127.0.0.1" if settings.host in ("0.0.0.0", "::", "") else settings.host
    body = (
        f'{{"model": "{model_name}", '
        '"messages": [{"role": "user", "content": "Say hello!"}], "max_tokens": 32}'
    )
    curl = (
        f"curl http://{host}:{settings.port}/v1/chat/completions "
        f"-H {shlex.quote('Authorization: Bearer ' + plaintext)} "
        "-H 'Content-Type: application/json' "
        f"-d {shlex.quote(body)}"
    )
    lines = [
        f"Created tenant '{DEMO_TENANT_NAME}'. Its API key is shown only this once:",
        f"  API key: {plaintext}",
        "Try it:",
        f"  {curl}",
    ]
    print("\n".join(lines), file=sys.stdout, flush=True)
    if not settings.key_hash_secret:
        log.warning("no --key-hash-secret set: API keys are hashed with a development secret")


# ---- authentication ----------------------------------------------------------------------------
def auth_middleware():
    """Bearer API keys on `/v1/...`; the tenant lands in `request[PRINCIPAL]`."""

    @web.middleware
    async def authenticate(request: web.Request, handler):
        if request.path.startswith(AUTHENTICATED_PREFIX):
            try:
                request[PRINCIPAL] = await principal_of(request)
            except APIError as error:  # a page asks the browser for the key
                raise page_auth.challenged(request, error) from None
        return await handler(request)

    return authenticate


def bearer_token(request: web.Request) -> str | None:
    """`Bearer <key>`; on a GET or HEAD also Basic with the key as password (the pages)."""
    scheme, _, token = request.headers.get("Authorization", "").partition(" ")
    if scheme.lower() != "bearer" or not token.strip():
        return page_auth.basic_password(request)
    return token.strip()


async def principal_of(request: web.Request) -> Principal:
    token = bearer_token(request)
    if token is None:
        raise missing_api_key()
    try:
        result = await request.app[AUTHENTICATOR].authenticate(token)
    except Exception:
        log.warning("authentication lookup failed", exc_info=True)
        raise overloaded("The API key could not be checked right now.", 1.0) from None
    if result is None:
        raise invalid_api_key()
    ended = result.ended_message(utcnow())
    if ended is not None:
        raise APIError(401, ended, code="expired_api_key")
    check_endpoint(result.key, request.path)
    return Principal(tenant=result.tenant, key_id=result.key.id, key=result.key)


# ---- probes ------------------------------------------------------------------------------------
async def healthz(request: web.Request) -> web.Response:
    return web.json_response({"status": "ok"})


async def readyz(request: web.Request) -> web.Response:
    checks = {
        "model": is_engine_running(request.app),
        "database": await is_database_reachable(request.app),
        "redis": await is_redis_reachable(request.app),
        "accepting": not request.app[SERVING_STATE].is_draining,
    }
    # With --rate-limit-on-error=open a Redis outage only lifts the rate limits (requests are
    # still served), so it must not take the replica out of the load balancer; fail-closed
    # refuses every request without Redis, so there Redis is part of being ready.
    # Likewise with --auth-stale-for, known keys are served through a database outage (audit
    # records wait in the spool), so the database is not part of being ready.
    required = dict(checks)
    if request.app[SETTINGS].rate_limit_on_error == "open":
        required.pop("redis")
    if request.app[SETTINGS].auth_stale_for > 0:
        required.pop("database")
    ready = all(required.values())
    body = {"status": "ready" if ready else "not ready", "checks": checks}
    return web.json_response(body, status=200 if ready else 503)


def is_engine_running(app: web.Application) -> bool:
    client = app.get(ENGINE_CLIENT)
    return client is not None and client.is_running


async def is_database_reachable(app: web.Application) -> bool:
    from gateway.db import check_database

    return await check_database(app[DATABASE])


async def is_redis_reachable(app: web.Application) -> bool:
    try:
        return bool(await asyncio.wait_for(app[REDIS].ping(), REDIS_PING_TIMEOUT_S))
    except Exception:
        return False
