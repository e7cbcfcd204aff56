"""The admin API, a sub-app mounted at `/admin`, behind `Authorization: Bearer <admin token>`.

Admin tokens (`--admin-tokens` / `CONVEYOR_ADMIN_TOKENS`, comma-separated) are compared in
constant time. No token: 401. A tenant's API key: 403 (tenants have no admin rights). Any other
token: 401. With no admin token configured the whole sub-app answers 403.

Every route is declared once in `ROUTES` (see `gateway.openapi.Route`): the handlers are added
from it and `GET /admin/openapi.json` is generated from it. Tenants and keys live in
`gateway.admin_tenants`, the audit queries in `gateway.admin_requests`.
"""

from __future__ import annotations

import hmac
import time
from typing import Any

from aiohttp import web
from pydantic import BaseModel, Field

from gateway import admin_requests as requests_api
from gateway import admin_tenants as tenants_api
from gateway.appkeys import AUTHENTICATOR, ENGINE, METRICS, SERVING_STATE, SETTINGS
from gateway.errors import APIError
from gateway.openapi import BEARER_ADMIN, Route, add_routes, build_document
from gateway.tenants import looks_like_key

OPENAPI_PATH = "/openapi.json"


# ---- authentication --------------------------------------------------------------------------
def admin_token_middleware():
    @web.middleware
    async def require_admin_token(request: web.Request, handler):
        tokens = request.config_dict[SETTINGS].admin_tokens
        if not tokens:
            raise APIError(403, "The admin API is disabled: no --admin-tokens configured.")
        given = bearer(request)
        if given is None:
            raise APIError(401, "An admin token is required.", code="missing_admin_token")
        if not is_admin_token(given, tokens):
            if await is_tenant_key(request, given):
                raise APIError(
                    403, "Tenant API keys cannot use the admin API.", code="not_an_admin_token"
                )
            raise APIError(401, "A valid admin token is required.", code="invalid_admin_token")
        return await handler(request)

    return require_admin_token


def bearer(request: web.Request) -> str | None:
    scheme, _, token = request.headers.get("Authorization", "").partition(" ")
    if scheme.lower() != "bearer" or not token.strip():
        return None
    return token.strip()


def is_admin_token(given: str, tokens: list[str]) -> bool:
    """Compare with every token, in constant time each, without stopping at a match."""
    matches = [hmac.compare_digest(given.encode(), token.encode()) for token in tokens]
    return any(matches)


async def is_tenant_key(request: web.Request, given: str) -> bool:
    if not looks_like_key(given):
        return False
    try:
        return await request.config_dict[AUTHENTICATOR].authenticate(given) is not None
    except Exception:  # the database is down: a key-shaped token is still no admin token
        return True


# ---- live engine -----------------------------------------------------------------------------
class SequenceState(BaseModel):
    request_id: str = Field(description="the HTTP request id (x-request-id)")
    sequence_id: str = Field(description="the engine's id: <request_id>-<choice>")
    tenant: str
    priority: int
    status: str
    num_prompt_tokens: int
    num_output_tokens: int
    num_computed_tokens: int
    num_gpu_blocks: int
    num_cpu_blocks: int
    num_preemptions: int
    age_s: float = Field(description="seconds since the engine received it")


class PoolUsage(BaseModel):
    num_blocks: int
    num_free_blocks: int
    usage: float = Field(description="fraction of blocks in use, 0..1")


class EngineState(BaseModel):
    model: str
    max_model_len: int
    running: list[SequenceState]
    waiting: list[SequenceState]
    swapped: list[SequenceState]
    gpu_kv: PoolUsage
    cpu_kv: PoolUsage
    steps_per_s: float | None = Field(description="engine steps per second, last 10 s")
    mean_step_time_s: float | None = Field(description="mean of the last 100 steps")
    num_steps: int
    num_preemptions: dict[str, int]
    prefix_cache_hit_rate: float | None
    num_inflight_requests: int = Field(description="HTTP requests being served")
    num_inflight_sequences: int
    # flat fields kept from the first version of this endpoint
    num_gpu_blocks: int
    num_free_gpu_blocks: int
    num_used_gpu_blocks: int
    kv_cache_usage: float
    num_cpu_blocks: int
    num_free_cpu_blocks: int
    num_waiting: int
    num_running: int
    num_swapped: int


def sequence_state(request: Any, now: float) -> SequenceState:
    sequence_id = request.request_id
    http_id, _, choice = sequence_id.rpartition("-")
    return SequenceState(
        request_id=http_id if choice.isdigit() and http_id else sequence_id,
        sequence_id=sequence_id,
        tenant=request.tenant,
        priority=request.priority,
        status=request.status.value,
        num_prompt_tokens=request.num_prompt_tokens,
        num_output_tokens=request.num_output_tokens,
        num_computed_tokens=request.num_computed_tokens,
        num_gpu_blocks=len(request.block_ids),
        num_cpu_blocks=len(request.cpu_block_ids),
        num_preemptions=request.num_preemptions,
        age_s=max(now - request.arrival_time, 0.0),
    )


def pool(num_blocks: int, num_free: int) -> PoolUsage:
    return PoolUsage(
        num_blocks=num_blocks,
        num_free_blocks=num_free,
        usage=(num_blocks - num_free) / num_blocks if num_blocks else 0.0,
    )


def engine_snapshot(app: Any) -> EngineState:
    """Plain reads and list copies of the engine's state: the engine thread is never stopped."""
    async_engine = app[ENGINE]
    engine = async_engine.engine
    blocks, scheduler = engine.block_manager, engine.scheduler
    now = time.monotonic()
    running, waiting, swapped = (
        [sequence_state(r, now) for r in list(queue)]
        for queue in (scheduler.running, scheduler.waiting, scheduler.swapped)
    )
    step_times = list(async_engine.step_times)
    queries = blocks.num_prefix_queries
    state = app[SERVING_STATE]
    gpu = pool(blocks.num_gpu_blocks, blocks.num_free_gpu_blocks)
    cpu = pool(blocks.num_cpu_blocks, blocks.num_free_cpu_blocks)
    return EngineState(
        model=engine.model_name,
        max_model_len=engine.max_model_len,
        running=running,
        waiting=waiting,
        swapped=swapped,
        gpu_kv=gpu,
        cpu_kv=cpu,
        steps_per_s=app[METRICS].step_rate.rate(),
        mean_step_time_s=sum(step_times) / len(step_times) if step_times else None,
        num_steps=engine.num_steps,
        num_preemptions=dict(scheduler.num_preemptions),
        prefix_cache_hit_rate=blocks.num_prefix_hits / queries if queries else None,
        num_inflight_requests=len(state.inflight),
        num_inflight_sequences=state.num_inflight_sequences,
        num_gpu_blocks=gpu.num_blocks,
        num_free_gpu_blocks=gpu.num_free_blocks,
        num_used_gpu_blocks=gpu.num_blocks - gpu.num_free_blocks,
        kv_cache_usage=gpu.usage,
        num_cpu_blocks=cpu.num_blocks,
        num_free_cpu_blocks=cpu.num_free_blocks,
        num_waiting=len(waiting),
        num_running=len(running),
        num_swapped=len(swapped),
    )


async def engine_state(request: web.Request) -> web.Response:
    snapshot = engine_snapshot(request.config_dict)
    return web.json_response(text=snapshot.model_dump_json())


class CancelResult(BaseModel):
    id: str
    status: str = Field(description="cancelling: its sequences are being aborted")
    num_sequences: int


async def cancel_request(request: web.Request) -> web.Response:
    """Abort an in-flight request on this replica: its response ends with finish_reason
    "abort", its unused tokens are refunded and its audit record says `cancelled`."""
    request_id = request.match_info["request_id"]
    tracker = request.config_dict[SERVING_STATE].inflight.get(request_id)
    if tracker is None:
        raise APIError(
            404, f"No request {request_id!r} is running on this replica.", code="not_found"
        )
    tracker.cancel(request.config_dict[ENGINE])
    result = CancelResult(
        id=request_id, status="cancelling", num_sequences=tracker.plan.num_choices
    )
    return web.json_response(text=result.model_dump_json(), status=202)


async def openapi_document(request: web.Request) -> web.Response:
    return web.json_response(admin_document())


def admin_document() -> dict[str, Any]:
    return build_document("Conveyor admin API", "/admin", ROUTES, BEARER_ADMIN)


# ---- the sub-app -----------------------------------------------------------------------------
T, R = tenants_api, requests_api
TENANT_ID = {"tenant_id": "integer"}
ROUTES = [
    Route("POST", "/tenants", T.create_tenant_handler, "Create a tenant",
          body=T.TenantCreate, responses={201: T.TenantOut}, tag="tenants"),
    Route("GET", "/tenants", T.list_tenants_handler, "List tenants",
          responses={200: T.TenantList}, tag="tenants"),
    Route("GET", "/tenants/{tenant_id}", T.get_tenant_handler, "Get a tenant",
          responses={200: T.TenantOut}, path_types=TENANT_ID, tag="tenants"),
    Route("PATCH", "/tenants/{tenant_id}", T.update_tenant_handler,
          "Change a tenant's limits, priorities, weight or enabled flag",
          body=T.TenantPatch, responses={200: T.TenantOut}, path_types=TENANT_ID, tag="tenants"),
    Route("DELETE", "/tenants/{tenant_id}", T.delete_tenant_handler,
          "Delete a tenant and its keys (its audit records stay)",
          responses={204: None}, path_types=TENANT_ID, tag="tenants"),
    Route("POST", "/tenants/{tenant_id}/keys", T.create_key_handler,
          "Create an API key (returned once, in `key`)",
          responses={201: T.KeyCreated}, path_types=TENANT_ID, tag="keys"),
    Route("GET", "/tenants/{tenant_id}/keys", T.list_keys_handler,
          "List a tenant's keys (prefixes and dates, never the keys)",
          responses={200: T.KeyList}, path_types=TENANT_ID, tag="keys"),
    Route("DELETE", "/keys/{key_id}", T.revoke_key_handler, "Revoke an API key",
          responses={200: T.ApiKeyOut}, path_types={"key_id": "integer"}, tag="keys"),
    Route("GET", "/tenants/{tenant_id}/usage", T.usage_handler,
          "Tokens today and this month against quotas; live rate-limit state",
          responses={200: T.TenantUsage}, path_types=TENANT_ID, tag="tenants"),
    Route("GET", "/engine", engine_state,
          "Running, waiting and swapped requests; KV usage; step rate",
          responses={200: EngineState}, tag="engine"),
    Route("GET", "/requests", R.list_requests_handler, "Audit records, newest first",
          query=R.RequestQuery, responses={200: R.RequestPage}, tag="requests"),
    Route("GET", "/requests/{request_id}", R.get_request_handler,
          "One request: record, event timeline and the explanation of its delays",
          responses={200: R.RequestDetailOut}, tag="requests"),
    Route("POST", "/requests/{request_id}/cancel", cancel_request,
          "Cancel a request running on this replica",
          responses={202: CancelResult}, tag="requests"),
]  # fmt: skip


def create_admin_app() -> web.Application:
    admin = web.Application(middlewares=[admin_token_middleware()])
    add_routes(admin, ROUTES)
    admin.router.add_get(OPENAPI_PATH, openapi_document)
    return admin
