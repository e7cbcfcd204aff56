"""OpenAPI 3.1 documents built from the same pydantic models the handlers validate with.

Each route is declared once as a `Route` (method, path, handler, body/query/response models);
the app registers the handlers from that table and the document is rendered from it, so the
document cannot drift from what the server accepts (`gateway.admin.routes` for `/admin`,
`gateway.openai.routes` for `/v1`).
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


@dataclass(frozen=True)
class Route:
    method: str
    path: str  # relative to the app the route is added to
    handler: Handler | None
    summary: str
    body: type[BaseModel] | None = None
    query: type[BaseModel] | None = None
    responses: dict[int, type[BaseModel] | None] = field(default_factory=dict)
    path_types: dict[str, str] = field(default_factory=dict)  # name -> JSON type, default string
    streams: type[BaseModel] | None = None  # SSE chunk model when `stream: true`
    tag: str = ""


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
        "operationId": f"{route.method.lower()}_{route.handler.__name__ if route.handler else ''}",
        "parameters": path_parameters(route) + query_parameters(route),
        "responses": {},
    }
    if route.tag:
        operation["tags"] = [route.tag]
    if route.body is not None:
        body_schema = keyed[(route.body, "validation")]
        operation["requestBody"] = {
            "required": True,
            "content": {"application/json": {"schema": body_schema}},
        }
    for status, model in route.responses.items():
        operation["responses"][str(status)] = response_of(route, status, model, keyed)
    error_ref = keyed[(ErrorBody, "serialization")]
    operation["responses"]["default"] = {
        "description": "An error",
        "content": {"application/json": {"schema": error_ref}},
    }
    return operation


def response_of(route: Route, status: int, model, keyed) -> dict[str, Any]:
    if model is None:
        return {"description": "No content"}
    content = {"application/json": {"schema": keyed[(model, "serialization")]}}
    if route.streams is not None:
        chunk = keyed[(route.streams, "serialization")]
        content["text/event-stream"] = {
            "schema": {"type": "string", "description": "`data: <chunk JSON>` lines, then "
                       "`data: [DONE]`"},
            "x-chunk-schema": chunk,
        }  # fmt: skip
    return {"description": "OK", "content": content}


def path_parameters(route: Route) -> list[dict[str, Any]]:
    return [
        {
            "name": name,
            "in": "path",
            "required": True,
            "schema": {"type": route.path_types.get(name, "string")},
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
