"""OpenAPI 3.1 documents built from the same pydantic models the handlers validate with and
answer with.

Each route is declared once as a `Route` (method, path, handler, body/query/response models, the
errors it may answer, the headers it sends, links to other operations); the app registers the
handlers from that table and the document is rendered from it, so the document cannot drift
from what the server accepts and answers (`gateway.admin.routes` for `/admin`,
`gateway.openai.routes` for `/v1`). Errors every route may answer (a malformed request, an
oversized body or header, an unknown method) are declared on every operation.
"""

from __future__ import annotations

import re
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from aiohttp import web
from pydantic import BaseModel
from pydantic.json_schema import models_json_schema

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


PATH_PARAM = re.compile(r"\{(\w+)\}")


# ---- shared bodies ----------------------------------------------------------------------------
class ErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None
    code: str | None


class ErrorBody(BaseModel):
    """Every error, OpenAI-shaped."""

    error: ErrorDetail


# ---- headers and errors the server sends -------------------------------------------------------
def header(description: str, schema_type: str = "string") -> dict[str, Any]:
    return {"description": description, "schema": {"type": schema_type}}


REQUEST_ID_HEADER = {"x-request-id": header("this request's id; finds its audit record")}
RETRY_AFTER_HEADER = {"Retry-After": header("seconds to wait before retrying", "integer")}
RATE_LIMIT_HEADERS = {
    "x-ratelimit-limit-requests": header(
        "the tightest requests per minute that applied (the tenant's, the key's or the model's)",
        "integer",
    ),
    "x-ratelimit-remaining-requests": header("requests still admissible now", "integer"),
    "x-ratelimit-reset-requests": header("time until one more request is admissible, e.g. 1s"),
    "x-ratelimit-limit-tokens": header("the tightest tokens per minute that applied", "integer"),
    "x-ratelimit-remaining-tokens": header("tokens still admissible now", "integer"),
    "x-ratelimit-reset-tokens": header("time until the tokens are admissible again, e.g. 6ms"),
}
ERROR_HEADERS = {
    429: {**RETRY_AFTER_HEADER, **RATE_LIMIT_HEADERS},
    503: RETRY_AFTER_HEADER,
    405: {"Allow": header("the methods this path answers")},
}
# Every operation may answer these: aiohttp and the middlewares send them before any handler.
COMMON_ERRORS = {
    400: "a malformed request (HTTP syntax, JSON, a value out of range)",
    405: "a method the path does not answer",
    408: "a body that did not arrive in time",
    413: "a body over --max-body-bytes",
    414: "a request line over the limit",
    431: "a request header over the size limit, or too many headers",
    500: "an error of the server (never caused by the request)",
}
KEY_ERRORS = {
    401: "no API key, or one unknown, revoked, expired (rotated past its grace) or of a disabled"
    " tenant",
    403: "a model or endpoint outside the key's scopes (model_not_allowed, endpoint_not_allowed)",
}
AUTH_ERRORS = {
    401: "no admin token, or one that is not valid",
    403: "a tenant key, or no admin tokens configured",
}
RATE_LIMIT_ERRORS = {
    429: "over a rate limit, quota or concurrency limit of the tenant, its key or the model"
    " (the message names which)"
}
DRAINING_ERRORS = {503: "draining for a shutdown, overloaded, or the key store is unreachable"}


@dataclass(frozen=True)
class Route:
    method: str
    path: str  # relative to the app the route is added to
    handler: Handler | None
    summary: str
    body: type[BaseModel] | None = None
    body_required: bool = True  # False: no body at all means the body model's defaults
    query: type[BaseModel] | None = None
    responses: dict[int, type[BaseModel] | None] = field(default_factory=dict)
    path_schemas: dict[str, dict[str, Any]] = field(default_factory=dict)  # default: a string
    streams: type[BaseModel] | None = None  # SSE chunk model when `stream: true`
    tag: str = ""
    errors: dict[int, str] = field(default_factory=dict)  # status -> when, beyond COMMON_ERRORS
    headers: dict[str, dict[str, Any]] = field(default_factory=dict)  # on success responses
    links: dict[str, dict[str, Any]] = field(default_factory=dict)  # on the first 2xx response

    @property
    def operation_id(self) -> str:
        return f"{self.method.lower()}_{self.handler.__name__ if self.handler else ''}"


def add_routes(app: web.Application, routes: Sequence[Route]) -> None:
    for route in routes:
        if route.handler is not None:
            app.router.add_route(route.method, route.path, route.handler)


# ---- the document -----------------------------------------------------------------------------
def build_document(
    title: str, prefix: str, routes: Sequence[Route], security: dict[str, Any]
) -> dict[str, Any]:
    definitions = schema_definitions(routes)
    paths: dict[str, Any] = {}
    for route in routes:
        operation = operation_of(route, definitions)
        paths.setdefault(prefix + route.path, {})[route.method.lower()] = operation
    return {
        "openapi": "3.1.0",
        "info": {"title": title, "version": "0.1.0"},
        "paths": paths,
        "components": {"schemas": definitions["$defs"], "securitySchemes": security},
        "security": [{name: []} for name in security],
    }


def schema_definitions(routes: Sequence[Route]) -> dict[str, Any]:
    """Component schemas of every model, keyed by (model, mode) -> `$ref` and `$defs`."""
    inputs = [(model, "validation") for route in routes for model in (route.body,) if model]
    outputs = [
        (model, "serialization")
        for route in routes
        for model in [*route.responses.values(), route.streams, ErrorBody]
        if model
    ]
    pairs = list(dict.fromkeys(inputs + outputs))
    keyed, top = models_json_schema(pairs, ref_template="#/components/schemas/{model}")
    return {"keyed": keyed, "$defs": top.get("$defs", {})}


def operation_of(route: Route, definitions: dict[str, Any]) -> dict[str, Any]:
    keyed = definitions["keyed"]
    operation: dict[str, Any] = {
        "summary": route.summary,
        "operationId": route.operation_id,
        "parameters": path_parameters(route) + query_parameters(route),
        "responses": {},
    }
    if route.tag:
        operation["tags"] = [route.tag]
    if route.body is not None:
        body_schema = keyed[(route.body, "validation")]
        operation["requestBody"] = {
            "required": route.body_required,
            "content": {"application/json": {"schema": body_schema}},
        }
    for status, model in route.responses.items():
        operation["responses"][str(status)] = response_of(route, status, model, keyed)
    error_ref = keyed[(ErrorBody, "serialization")]
    for status, when in sorted({**COMMON_ERRORS, **route.errors}.items()):
        operation["responses"][str(status)] = error_response(status, when, error_ref)
    return operation


def error_response(status: int, when: str, error_ref: dict[str, Any]) -> dict[str, Any]:
    return {
        "description": when,
        "headers": {**REQUEST_ID_HEADER, **ERROR_HEADERS.get(status, {})},
        "content": {"application/json": {"schema": error_ref}},
    }


def response_of(route: Route, status: int, model, keyed) -> dict[str, Any]:
    headers = {**REQUEST_ID_HEADER, **route.headers}
    if model is None:
        return {"description": "No content", "headers": headers}
    content = {"application/json": {"schema": keyed[(model, "serialization")]}}
    if route.streams is not None:
        content["text/event-stream"] = {"schema": sse_event_schema(route, keyed)}
    response = {"description": "OK", "headers": headers, "content": content}
    if route.links and status == min(route.responses):
        response["links"] = route.links
    return response


def sse_event_schema(route: Route, keyed) -> dict[str, Any]:
    """One event of a `stream: true` answer (Open API 3.1: `schema` describes each event): its
    `data` is a chunk as JSON, an error as JSON (in-band, once the headers are gone), or the
    closing `[DONE]`."""
    chunk = keyed[(route.streams, "serialization")]
    error = keyed[(ErrorBody, "serialization")]
    as_json = {
        "type": "string",
        "contentMediaType": "application/json",
        "contentSchema": {"anyOf": [chunk, error]},
    }
    return {
        "type": "object",
        "properties": {"data": {"anyOf": [as_json, {"const": "[DONE]"}]}},
        "required": ["data"],
    }


def path_parameters(route: Route) -> list[dict[str, Any]]:
    return [
        {
            "name": name,
            "in": "path",
            "required": True,
            "schema": route.path_schemas.get(name, {"type": "string"}),
        }
        for name in PATH_PARAM.findall(route.path)
    ]


def query_parameters(route: Route) -> list[dict[str, Any]]:
    if route.query is None:
        return []
    schema = route.query.model_json_schema(ref_template="#/components/schemas/{model}")
    required = set(schema.get("required", []))
    return [
        {
            "name": name,
            "in": "query",
            "required": name in required,
            "description": prop.get("description", ""),
            "schema": {k: v for k, v in prop.items() if k not in ("description", "title")},
        }
        for name, prop in schema.get("properties", {}).items()
    ]


BEARER_ADMIN = {"adminToken": {"type": "http", "scheme": "bearer", "description": "admin token"}}


BEARER_KEY = {"apiKey": {"type": "http", "scheme": "bearer", "description": "tenant API key"}}
