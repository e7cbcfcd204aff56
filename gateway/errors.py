"""OpenAI-shaped errors: `{"error": {"message", "type", "param", "code"}}` with the right status.

Handlers raise `APIError`; `error_middleware` turns it, aiohttp's own HTTP errors (unknown route,
wrong method, body over the size limit) and anything unexpected into that shape. Nothing a
client sends may produce a traceback in a response: unexpected errors are logged here and
answered with a generic 500.
"""

from __future__ import annotations

import logging
import math
import uuid
from typing import Any

from aiohttp import web
from pydantic import ValidationError

from gateway.appkeys import REQUEST_ID

log = logging.getLogger(__name__)

INVALID_REQUEST = "invalid_request_error"
SERVER_ERROR = "server_error"


class APIError(Exception):
    def __init__(
        self,
        status: int,
        message: str,
        *,
        type: str = INVALID_REQUEST,
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status, self.message, self.type = status, message, type
        self.param, self.code, self.headers = param, code, dict(headers or {})

    def body(self) -> dict[str, Any]:
        return {
            "error": {
                "message": self.message,
                "type": self.type,
                "param": self.param,
                "code": self.code,
            }
        }

    def response(self) -> web.Response:
        return web.json_response(self.body(), status=self.status, headers=self.headers)


# ---- the errors handlers raise --------------------------------------------------------------
def bad_request(message: str, param: str | None = None, code: str | None = None) -> APIError:
    return APIError(400, message, param=param, code=code)


def model_not_found(model: str) -> APIError:
    return APIError(
        404,
        f"The model `{model}` does not exist.",
        param="model",
        code="model_not_found",
    )


def invalid_api_key(message: str = "Incorrect API key provided.") -> APIError:
    return APIError(401, message, code="invalid_api_key")


def missing_api_key() -> APIError:
    return APIError(
        401,
        "You didn't provide an API key. Send it as 'Authorization: Bearer <key>'.",
        code="missing_api_key",
    )


def overloaded(message: str, retry_after_s: float = 1.0) -> APIError:
    return APIError(
        503,
        message,
        type=SERVER_ERROR,
        code="service_unavailable",
        headers={"Retry-After": str(max(1, math.ceil(retry_after_s)))},
    )


TYPE_TAGS = frozenset({"str", "int", "float", "bool", "list", "dict", "none"})


def is_field_name(part: str | int) -> bool:
    """Pydantic puts union members ("str", "list[int]", "TextPart") into error locations."""
    if isinstance(part, int):
        return True
    return part not in TYPE_TAGS and "[" not in part and not part[:1].isupper()


def from_validation_error(error: ValidationError) -> APIError:
    """The most specific problem pydantic found, with its field path as `param`."""
    problems = error.errors(include_url=False)
    problem = max(problems, key=lambda p: len(p["loc"]))  # the deepest says the most
    if problem["type"] == "json_invalid":
        return bad_request(f"We could not parse the JSON body of your request: {problem['msg']}")
    location = ".".join(str(part) for part in problem["loc"] if is_field_name(part))
    if not location:
        return bad_request(f"Invalid request body: {problem['msg']}")
    return bad_request(f"Invalid value for '{location}': {problem['msg']}", param=location)


# ---- HTTP errors raised by aiohttp itself ---------------------------------------------------
HTTP_ERROR_CODES = {
    404: "not_found",
    405: "method_not_allowed",
    413: "request_too_large",
}


def from_http_exception(error: web.HTTPException) -> APIError:
    if error.status == 413:
        message = f"Request body too large: {error.text or ''}".strip()
    else:
        message = f"{error.status} {error.reason}"
    error_type = SERVER_ERROR if error.status >= 500 else INVALID_REQUEST
    headers = {k: v for k, v in error.headers.items() if k.lower() in ("allow", "retry-after")}
    return APIError(
        error.status,
        message,
        type=error_type,
        code=HTTP_ERROR_CODES.get(error.status),
        headers=headers,
    )


def internal_error() -> APIError:
    return APIError(
        500,
        "The server had an error while processing your request. Sorry about that!",
        type=SERVER_ERROR,
    )


# ---- middlewares ----------------------------------------------------------------------------
def request_id_middleware():
    """Gives every request an id; `on_response_prepare` copies it into `x-request-id`."""

    @web.middleware
    async def assign_request_id(request: web.Request, handler):
        request[REQUEST_ID] = uuid.uuid4().hex
        return await handler(request)

    return assign_request_id


async def add_request_id_header(request: web.Request, response: web.StreamResponse) -> None:
    """`on_response_prepare` signal: runs for every response, streamed ones included."""
    request_id = request.get(REQUEST_ID)
    if request_id is not None:
        response.headers["x-request-id"] = request_id


def error_middleware():
    @web.middleware
    async def render_errors(request: web.Request, handler):
        try:
            return await handler(request)
        except APIError as error:
            return error.response()
        except web.HTTPException as error:
            if error.status < 400:
                raise
            return from_http_exception(error).response()
        except Exception:
            log.exception("unhandled error on %s %s", request.method, request.path)
            return internal_error().response()

    return render_errors
