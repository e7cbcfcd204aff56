"""HTML of the pages: Jinja2 templates from the package, autoescaped, so that no string from a
request (ids, tenant names, sentences) reaches the page unescaped; and the headers every page
carries."""

from __future__ import annotations

from functools import cache
from typing import Any

from aiohttp import web
from jinja2 import Environment, PackageLoader, select_autoescape

from gateway.audit.timeline import Cause, Segment, Timeline
from gateway.pages.layout import Neighbour, draw

STATIC_PREFIX = "/pages/static"
CONTENT_SECURITY_POLICY = "; ".join(
    [
        "default-src 'none'",
        "script-src 'self'",
        "style-src 'self'",
        "img-src 'self'",
        "connect-src 'self'",
        "base-uri 'none'",
        "form-action 'self'",
        "frame-ancestors 'none'",
    ]
)
PAGE_HEADERS = {
    "Content-Security-Policy": CONTENT_SECURITY_POLICY,
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
    "Cache-Control": "no-store",
    "X-Frame-Options": "DENY",
}


@cache
def environment() -> Environment:
    env = Environment(
        loader=PackageLoader("gateway.pages", "templates"),
        autoescape=select_autoescape(default=True, default_for_string=True),
        trim_blocks=True,
        lstrip_blocks=True,
    )
    env.filters["secs"] = exact_seconds
    env.filters["fixed"] = lambda value: f"{value:.6f}"
    env.globals["static"] = STATIC_PREFIX
    return env


def page(template: str, status: int = 200, **context: Any) -> web.Response:
    html = environment().get_template(template).render(**context)
    return web.Response(
        text=html, status=status, content_type="text/html", charset="utf-8", headers=PAGE_HEADERS
    )


def exact_seconds(value: float | None) -> str:
    if value is None:
        return "-"
    return f"{value * 1000:.1f} ms" if abs(value) < 1 else f"{value:.3f} s"


def timeline_page(
    timeline: Timeline, neighbours: list[Neighbour], *, prefix: str, operator: bool
) -> web.Response:
    """`prefix`: "/v1" or "/admin", where this viewer's request links point."""
    return page(
        "timeline.html",
        timeline=timeline,
        drawing=draw(timeline, neighbours),
        neighbours=neighbours,
        prefix=prefix,
        operator=operator,
        cause_text=cause_text,
        cause_link=lambda cause: cause_link(cause, prefix),
        hover_times=hover_times,
        phases_text=phases_text,
    )


def not_found_page(given_id: str, *, prefix: str, operator: bool) -> web.Response:
    return page("not_found.html", 404, given_id=given_id, prefix=prefix, operator=operator)


def console_page() -> web.Response:
    return page("console.html", operator=True, prefix="/admin")


def cause_text(cause: Cause | None) -> str:
    if cause is None:
        return ""
    if cause.is_self:
        return "its own growth: it needed another KV block and was the least urgent"
    if cause.request_id is None:
        return f"a request of another tenant (priority {cause.priority})"
    return f"request {cause.request_id} (priority {cause.priority}, tenant {cause.tenant})"


def cause_link(cause: Cause | None, prefix: str) -> str | None:
    if cause is None or cause.is_self or cause.request_id is None:
        return None
    return f"{prefix}/requests/{cause.request_id}/timeline"


def hover_times(segment: Segment) -> str:
    return (
        f"+{exact_seconds(segment.start_s)} to +{exact_seconds(segment.end_s)} "
        f"({exact_seconds(segment.duration_s)})"
    )


def phases_text(segment: Segment) -> str:
    return " · ".join(
        f"{name}: {exact_seconds(end - begin)}" for name, begin, end in segment.phases
    )
