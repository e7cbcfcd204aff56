"""Opening the pages in a plain browser, which cannot send `Authorization: Bearer`: HTTP Basic
with the API key (or the admin token) as the password, any user name. A page answers a missing or
wrong credential with a Basic challenge, so the browser asks once and then sends it with the
page's own reads (the console's `fetch` of `/admin/engine` and `/admin/requests`).

Basic is taken only where a page needs it: the pages themselves and the console's two reads,
and only for GET and HEAD. A browser sends it without being asked, so another site must never
be able to spend a tenant's tokens or rate limit, or change anything (CSRF); these reads have no
side effects, and no other origin can read their answers."""

from __future__ import annotations

import base64
import binascii

from aiohttp import web

from gateway.errors import APIError

CHALLENGE = 'Basic realm="Conveyor", charset="UTF-8"'
SAFE_METHODS = ("GET", "HEAD")
CONSOLE_READS = ("/admin/engine", "/admin/requests")


def basic_password(request: web.Request) -> str | None:
    """The password of `Authorization: Basic …` on a page or a console read, or None."""
    if request.method not in SAFE_METHODS or not takes_basic(request.path):
        return None
    scheme, _, value = request.headers.get("Authorization", "").partition(" ")
    if scheme.lower() != "basic":
        return None
    try:
        decoded = base64.b64decode(value.strip(), validate=True).decode("utf-8")
    except (binascii.Error, UnicodeDecodeError):
        return None
    _, colon, password = decoded.partition(":")
    return password.strip() or None if colon else None


def takes_basic(path: str) -> bool:
    return is_page(path) or path in CONSOLE_READS


def is_page(path: str) -> bool:
    return path.endswith("/timeline") or path == "/admin/console"


def challenged(request: web.Request, error: APIError) -> APIError:
    """A 401 on a page asks the browser for the key (Basic); the API's 401s stay as they are."""
    if error.status == 401 and request.method in SAFE_METHODS and is_page(request.path):
        error.headers["WWW-Authenticate"] = CHALLENGE
    return error
