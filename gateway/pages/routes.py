"""The pages' handlers and where they are mounted: the tenant's timeline under `/v1` (its key,
checked by the app's auth middleware), the operator's timeline and console in the admin sub-app
(its admin-token middleware), and the static files, public, under `/pages/static/`.

Each page's search box submits `?find=<id>`: the page answers with a redirect to that id's
timeline, for the same viewer."""

from __future__ import annotations

import asyncio
from functools import cache
from importlib import resources

from aiohttp import web

from gateway.appkeys import PRINCIPAL
from gateway.audit.ids import record_id_of
from gateway.audit.queries import RequestDetail
from gateway.audit.routes import REQUEST_ID_PATTERN, find_detail
from gateway.audit.timeline import Timeline, build_timeline
from gateway.errors import APIError
from gateway.pages.layout import Neighbour
from gateway.pages.render import STATIC_PREFIX, console_page, not_found_page, timeline_page

MAX_NEIGHBOURS = 8  # requests that preempted this one, drawn below it
STATIC_TYPES = {
    "conveyor.js": "text/javascript",
    "conveyor.css": "text/css",
    "favicon.svg": "image/svg+xml",
}


def add_tenant_routes(router: web.UrlDispatcher) -> None:
    router.add_get("/v1/requests/{request_id}/timeline", tenant_timeline)
    router.add_get(STATIC_PREFIX + "/{name}", static_file)


def add_admin_routes(router: web.UrlDispatcher) -> None:
    """On the admin sub-app (paths relative to `/admin`)."""
    router.add_get("/requests/{request_id}/timeline", operator_timeline)
    router.add_get("/console", console)


async def tenant_timeline(request: web.Request) -> web.StreamResponse:
    tenant = request[PRINCIPAL].tenant
    return await timeline(request, "/v1", tenant.id, tenant.name)


async def operator_timeline(request: web.Request) -> web.StreamResponse:
    return await timeline(request, "/admin", None, None)


async def console(request: web.Request) -> web.StreamResponse:
    found = found_redirect(request, "/admin")
    return found if found is not None else console_page()


async def timeline(
    request: web.Request, prefix: str, tenant_id: int | None, viewer: str | None
) -> web.StreamResponse:
    found = found_redirect(request, prefix)
    if found is not None:
        return found
    given_id = request.match_info["request_id"]
    operator = viewer is None
    try:
        detail = await find_detail(request, given_id, tenant_id)
    except APIError as error:
        if error.status != 404:
            raise
        return not_found_page(given_id, prefix=prefix, operator=operator)
    # building and rendering a long trail takes milliseconds to tens of them: off the loop
    drawn = await asyncio.to_thread(timeline_of, detail, viewer)
    others = await neighbour_details(request, drawn, tenant_id)
    return await asyncio.to_thread(with_neighbours, detail, drawn, others, prefix, viewer)


def timeline_of(detail: RequestDetail, viewer: str | None) -> Timeline:
    events = [event.model_dump() for event in detail.events]
    return build_timeline(detail.record.model_dump(), events, viewer_tenant=viewer)


async def neighbour_details(
    request: web.Request, drawn: Timeline, tenant_id: int | None
) -> list[RequestDetail]:
    """The requests that preempted this one and that the viewer may see (an operator: all; a
    tenant: its own; another tenant's request id is not in a tenant's timeline at all)."""
    causes = [s.cause for lane in drawn.lanes for s in lane.segments if s.cause is not None]
    ids = [c.request_id for c in causes if c.request_id and not c.is_self]
    details = []
    for request_id in list(dict.fromkeys(ids))[:MAX_NEIGHBOURS]:
        try:
            details.append(await find_detail(request, request_id, tenant_id))
        except APIError:
            continue  # not (yet) in the audit log, or not this tenant's
    return details


def with_neighbours(
    detail: RequestDetail,
    drawn: Timeline,
    others: list[RequestDetail],
    prefix: str,
    viewer: str | None,
) -> web.Response:
    """The page, with the neighbours drawn below on the same axis, placed by arrival time."""
    neighbours = []
    for other in others:
        offset = other.record.received_at - detail.record.received_at
        link = f"{prefix}/requests/{other.record.id}/timeline"
        neighbours.append(Neighbour(timeline_of(other, viewer), offset.total_seconds(), link))
    return timeline_page(drawn, neighbours, prefix=prefix, operator=viewer is None)


def found_redirect(request: web.Request, prefix: str) -> web.StreamResponse | None:
    """`?find=<id>` from the search box: the timeline of that id, or a not-found page."""
    given = request.query.get("find")
    if given is None:
        return None
    given = given.strip()
    if not REQUEST_ID_PATTERN.fullmatch(given):
        return not_found_page(given, prefix=prefix, operator=prefix == "/admin")
    raise web.HTTPSeeOther(f"{prefix}/requests/{record_id_of(given)}/timeline")


async def static_file(request: web.Request) -> web.Response:
    name = request.match_info["name"]
    if name not in STATIC_TYPES:
        raise APIError(404, "No such file.", code="not_found")
    return web.Response(
        body=static_bytes(name),
        content_type=STATIC_TYPES[name],
        headers={"Cache-Control": "public, max-age=300", "X-Content-Type-Options": "nosniff"},
    )


@cache
def static_bytes(name: str) -> bytes:
    return resources.files("gateway.pages").joinpath("static", name).read_bytes()
