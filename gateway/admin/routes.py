"""The admin API, a sub-app mounted at `/admin`, behind `Authorization: Bearer <admin token>`.

Admin tokens (`--admin-tokens` / `CONVEYOR_ADMIN_TOKENS`, comma-separated) are compared in
constant time. No token: 401. A tenant's API key: 403 (tenants have no admin rights). Any other
token: 401. With no admin token configured the whole sub-app answers 403.

Every route is declared once in `ROUTES` (see `gateway.openapi.Route`): the handlers are added
from it and `GET /admin/openapi.json` is generated from it. Tenants and keys live in
`gateway.admin.tenants`, the audit queries in `gateway.audit.routes`.
"""

from __future__ import annotations

import hmac
import typing
from dataclasses import fields
from typing import Any

from aiohttp import web
from pydantic import BaseModel, Field, create_model

from gateway.admin import keys as keys_api
from gateway.admin import tenants as tenants_api
from gateway.appkeys import AUTHENTICATOR, ENGINE_CLIENT, METRICS, SERVING_STATE, SETTINGS
from gateway.audit import routes as requests_api
from gateway.audit.ids import split_sequence_id
from gateway.errors import APIError
from gateway.openapi import AUTH_ERRORS, BEARER_ADMIN, Route, add_routes, build_document
from gateway.pages import auth as page_auth
from gateway.pages import routes as pages
from gateway.tenancy.key_models import ApiKeyOut, KeyCreate, KeyPatch, KeyRotate
from gateway.tenancy.keys import looks_like_key
from runtime.engine_client import SequenceSnapshot

OPENAPI_PATH = "/openapi.json"


# ---- authentication --------------------------------------------------------------------------
def admin_token_middleware():
    @web.middleware
    async def require_admin_token(request: web.Request, handler):
        try:
            await check_admin_token(request)
        except APIError as error:  # a page asks the browser for the token
            raise page_auth.challenged(request, error) from None
        return await handler(request)

    return require_admin_token


async def check_admin_token(request: web.Request) -> None:
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


def bearer(request: web.Request) -> str | None:
    """`Bearer <token>`; on a GET or HEAD also Basic with the token as password (the pages)."""
    scheme, _, token = request.headers.get("Authorization", "").partition(" ")
    if scheme.lower() != "bearer" or not token.strip():
        return page_auth.basic_password(request)
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
def _snapshot_fields() -> dict[str, Any]:
    """SequenceSnapshot's fields as pydantic field definitions (the engine's clock left out)."""
    hints = typing.get_type_hints(SequenceSnapshot)
    return {
        f.name: (hints[f.name], ...)
        for f in fields(SequenceSnapshot)
        if f.name not in ("arrival_time", "sequence_id")
    }


# a running, waiting or swapped sequence: the engine's snapshot of it, and what it means here
SequenceState = create_model(
    "SequenceState",
    request_id=(str, Field(description="the HTTP request id (x-request-id)")),
    sequence_id=(str, Field(description="the engine's id: <request_id>-<choice>")),
    age_s=(float, Field(description="seconds since the engine received it")),
    **_snapshot_fields(),
)


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
    num_output_tokens: int = Field(
        description="output tokens generated since the engine started (a rate's numerator: "
        "sequences that start and end between two reads count too)"
    )
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


def sequence_state(sequence: SequenceSnapshot, now: float) -> SequenceState:
    snapshot = {f.name: getattr(sequence, f.name) for f in fields(SequenceSnapshot)}
    arrival_time = snapshot.pop("arrival_time")
    parsed = split_sequence_id(sequence.sequence_id)
    return SequenceState(
        request_id=parsed[0] if parsed else sequence.sequence_id,
        age_s=max(now - arrival_time, 0.0),
        **snapshot,
    )


def pool(num_blocks: int, num_free: int) -> PoolUsage:
    return PoolUsage(
        num_blocks=num_blocks,
        num_free_blocks=num_free,
        usage=(num_blocks - num_free) / num_blocks if num_blocks else 0.0,
    )


async def engine_state_of(app: Any) -> EngineState:
    """The engine's snapshot (taken on its thread) with this replica's in-flight counts."""
    client = app[ENGINE_CLIENT]
    snapshot = await client.snapshot()
    running, waiting, swapped = (
        [sequence_state(s, snapshot.taken_at) for s in line]
        for line in (snapshot.running, snapshot.waiting, snapshot.swapped)
    )
    queries = snapshot.num_prefix_queries
    state = app[SERVING_STATE]
    gpu = pool(snapshot.num_gpu_blocks, snapshot.num_free_gpu_blocks)
    cpu = pool(snapshot.num_cpu_blocks, snapshot.num_free_cpu_blocks)
    return EngineState(
        model=client.info.model_name,
        max_model_len=client.info.max_model_len,
        running=running,
        waiting=waiting,
        swapped=swapped,
        gpu_kv=gpu,
        cpu_kv=cpu,
        steps_per_s=app[METRICS].step_rate.rate(),
        mean_step_time_s=snapshot.mean_step_time_s,
        num_steps=snapshot.num_steps,
        num_output_tokens=snapshot.num_output_tokens,
        num_preemptions=snapshot.num_preemptions,
        prefix_cache_hit_rate=snapshot.num_prefix_hits / queries if queries else None,
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
    state = await engine_state_of(request.config_dict)
    return web.json_response(text=state.model_dump_json())


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
    tracker.cancel(request.config_dict[ENGINE_CLIENT])
    result = CancelResult(
        id=request_id, status="cancelling", num_sequences=tracker.plan.num_choices
    )
    return web.json_response(text=result.model_dump_json(), status=202)


async def openapi_document(request: web.Request) -> web.Response:
    return web.json_response(admin_document())


def admin_document() -> dict[str, Any]:
    return build_document("Conveyor admin API", "/admin", ROUTES, BEARER_ADMIN)


# ---- the sub-app -----------------------------------------------------------------------------
T, K, R = tenants_api, keys_api, requests_api
TENANT_ID = {"tenant_id": T.ID_SCHEMA}
KEY_ID = {"key_id": T.ID_SCHEMA}
REQUEST_ID = {"request_id": R.REQUEST_ID_SCHEMA}
ADMIN = AUTH_ERRORS
FOUND = {**AUTH_ERRORS, 404: "no such tenant, key or request"}
CONFLICT = {409: "a name taken, or fields in conflict (max_priority above default_priority)"}
ROUTES = [
    Route("POST", "/tenants", T.create_tenant_handler, "Create a tenant",
          body=T.TenantCreate, responses={201: T.TenantOut}, errors={**ADMIN, **CONFLICT},
          tag="tenants"),
    Route("GET", "/tenants", T.list_tenants_handler, "List tenants",
          responses={200: T.TenantList}, errors=ADMIN, tag="tenants"),
    Route("GET", "/tenants/{tenant_id}", T.get_tenant_handler, "Get a tenant",
          responses={200: T.TenantOut}, path_schemas=TENANT_ID, errors=FOUND, tag="tenants"),
    Route("PATCH", "/tenants/{tenant_id}", T.update_tenant_handler,
          "Change a tenant's limits, priorities, weight or enabled flag",
          body=T.TenantPatch, responses={200: T.TenantOut}, path_schemas=TENANT_ID,
          errors={**FOUND, **CONFLICT}, tag="tenants"),
    Route("DELETE", "/tenants/{tenant_id}", T.delete_tenant_handler,
          "Delete a tenant and its keys (its audit records stay)",
          responses={204: None}, path_schemas=TENANT_ID, errors=FOUND, tag="tenants"),
    Route("POST", "/tenants/{tenant_id}/keys", K.create_key_handler,
          "Create an API key (returned once, in `key`): name, expiry, scopes, limits",
          body=KeyCreate, body_required=False, responses={201: K.KeyCreated}, path_schemas=TENANT_ID,
          errors={**FOUND, **CONFLICT}, tag="keys"),
    Route("GET", "/tenants/{tenant_id}/keys", K.list_keys_handler,
          "List a tenant's keys: state, last use, scopes and limits (never the keys)",
          responses={200: K.KeyList}, path_schemas=TENANT_ID, errors=FOUND, tag="keys"),
    Route("PATCH", "/keys/{key_id}", K.update_key_handler,
          "Change a key's name, expiry, scopes or limits",
          body=KeyPatch, responses={200: ApiKeyOut}, path_schemas=KEY_ID,
          errors={**FOUND, **CONFLICT}, tag="keys"),
    Route("POST", "/keys/{key_id}/rotate", K.rotate_key_handler,
          "Replace a key: the new one is returned once; the old one works until the grace ends",
          body=KeyRotate, body_required=False, responses={201: K.KeyRotated}, path_schemas=KEY_ID,
          errors={**FOUND, 409: "the key is revoked or already rotated"}, tag="keys"),
    Route("DELETE", "/keys/{key_id}", K.revoke_key_handler,
          "Revoke an API key (refused by every replica from its next request on)",
          responses={200: ApiKeyOut}, path_schemas=KEY_ID, errors=FOUND, tag="keys"),
    Route("GET", "/tenants/{tenant_id}/usage", T.usage_handler,
          "Tokens today and this month against quotas; live rate-limit state",
          responses={200: T.TenantUsage}, path_schemas=TENANT_ID, errors=FOUND, tag="tenants"),
    Route("GET", "/engine", engine_state,
          "Running, waiting and swapped requests; KV usage; step rate",
          responses={200: EngineState}, errors=ADMIN, tag="engine"),
    Route("GET", "/requests", R.list_requests_handler, "Audit records, newest first",
          query=R.RequestQuery, responses={200: R.RequestPage}, errors=ADMIN, tag="requests"),
    Route("GET", "/requests/{request_id}", R.get_request_handler,
          "One request: record, event timeline and the explanation of its delays",
          responses={200: R.RequestDetailOut}, path_schemas=REQUEST_ID, errors=FOUND,
          tag="requests"),
    Route("POST", "/requests/{request_id}/cancel", cancel_request,
          "Cancel a request running on this replica",
          responses={202: CancelResult}, path_schemas=REQUEST_ID, errors=FOUND, tag="requests"),
]  # fmt: skip


def create_admin_app() -> web.Application:
    admin = web.Application(middlewares=[admin_token_middleware()])
    add_routes(admin, ROUTES)
    admin.router.add_get(OPENAPI_PATH, openapi_document)
    pages.add_admin_routes(admin.router)  # the timeline and console pages (HTML)
    return admin
