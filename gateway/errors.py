"""OpenAI-shaped errors: `{"error": {"message", "type", "param", "code"}}` with the right status.

Handlers raise `APIError`; `error_middleware` turns it, aiohttp's own HTTP errors (unknown route,
wrong method, body over the size limit) and anything unexpected into that shape. What aiohttp
refuses before any handler runs (a header over the size limit, a malformed request line, an
unknown method) is answered in the same shape by `JsonErrorRequestHandler`, which
`JsonErrorAppRunner` installs. Nothing a client sends may produce a traceback in a response:
unexpected errors are logged here and answered with a generic 500.
"""

from __future__ import annotations

import logging
import math
import uuid
from typing import Any

from aiohttp import http_exceptions, web, web_protocol, web_server
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
        close_connection: bool = False,
    ) -> None:
        super().__init__(message)
        self.status, self.message, self.type = status, message, type
        self.param, self.code, self.headers = param, code, dict(headers or {})
        self.close_connection = close_connection  # the rest of the request cannot be trusted

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
        response = web.json_response(self.body(), status=self.status, headers=self.headers)
        if self.close_connection:
            response.force_close()
        return response


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
    return (
        part not in TYPE_TAGS
        and "[" not in part
        and "-" not in part  # "constrained-str", "function-after[...]"
        and not part[:1].isupper()
    )


def deepest_problem(error: ValidationError) -> dict[str, Any]:
    """Of pydantic's problems, the deepest says the most; but where a union's members all fail,
    "not a string" from the members the value is not says less than what is wrong with the
    member it is (a list of 33 prompts: too long, not "not an int")."""
    problems = error.errors(include_url=False)
    telling = [p for p in problems if not p["type"].endswith("_type")] or problems
    return max(telling, key=lambda p: len(p["loc"]))


def field_path(location: tuple[str | int, ...]) -> str:
    """`messages.0.content`, without pydantic's union member tags."""
    return ".".join(str(part) for part in location if is_field_name(part))


def from_validation_error(error: ValidationError) -> APIError:
    """The most specific problem pydantic found, with its field path as `param`."""
    problem = deepest_problem(error)
    if problem["type"] == "json_invalid":
        return bad_request(f"We could not parse the JSON body of your request: {problem['msg']}")
    location = field_path(problem["loc"])
    if not location:
        return bad_request(f"Invalid request body: {problem['msg']}")
    return bad_request(f"Invalid value for '{location}': {problem['msg']}", param=location)


# ---- HTTP errors raised by aiohttp itself ---------------------------------------------------
HTTP_ERROR_CODES = {
    400: "bad_request",
    404: "not_found",
    408: "request_timeout",
    405: "method_not_allowed",
    413: "request_too_large",
    414: "uri_too_long",
    431: "request_header_fields_too_large",
    500: None,
    504: "timeout",
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
        except (http_exceptions.HttpProcessingError, web_protocol.RequestPayloadError) as error:
            error = protocol_error(400, error, 0)
            error.close_connection = True
            return error.response()
        except Exception:
            log.exception("unhandled error on %s %s", request.method, request.path)
            return internal_error().response()

    return render_errors


# ---- errors aiohttp answers before any handler runs -------------------------------------------
MAX_REQUEST_LINE_BYTES = 16384  # differs from the header limit, to tell 414 from 431
MAX_HEADER_FIELD_BYTES = 8190  # aiohttp's default; a longer header line is a 431
HANDLER_ARGS = {"max_line_size": MAX_REQUEST_LINE_BYTES, "max_field_size": MAX_HEADER_FIELD_BYTES}


def protocol_error(status: int, exc: BaseException | None, line_limit: int) -> APIError:
    """What aiohttp's HTTP parser refused (or a 500/504 outside every middleware), as JSON."""
    if isinstance(exc, http_exceptions.LineTooLong):
        if exc.args[1:2] == (line_limit,):
            return APIError(414, "The request line is too long.", code=HTTP_ERROR_CODES[414])
        message = "A request header is too large."
        return APIError(431, message, code=HTTP_ERROR_CODES[431])
    if isinstance(exc, http_exceptions.BadHttpMessage) and "Too many headers" in exc.message:
        return APIError(431, "Too many request headers.", code=HTTP_ERROR_CODES[431])
    if isinstance(exc, http_exceptions.BadHttpMethod):
        return APIError(405, "Unknown HTTP method.", code=HTTP_ERROR_CODES[405])
    if isinstance(exc, http_exceptions.HttpProcessingError):
        message = f"Malformed HTTP request: {exc.message}"
        return APIError(400, message, code=HTTP_ERROR_CODES[400])
    if isinstance(exc, web_protocol.RequestPayloadError):  # e.g. a body that is not gzip
        message = f"The request body could not be decoded: {exc.__cause__ or exc}".strip()
        return APIError(400, message, code=HTTP_ERROR_CODES[400])
    if status == 504:
        return APIError(504, "The request timed out.", type=SERVER_ERROR, code="timeout")
    if status >= 500:
        return internal_error()
    return APIError(status, f"{status} Bad request", code=HTTP_ERROR_CODES.get(status))


class JsonErrorRequestHandler(web_protocol.RequestHandler):
    """aiohttp's connection handler, answering its own errors OpenAI-shaped instead of in plain
    text (aiohttp offers no hook for this but overriding `handle_error`)."""

    def handle_error(
        self,
        request: web.BaseRequest,
        status: int = 500,
        exc: BaseException | None = None,
        message: str | None = None,
    ) -> web.StreamResponse:
        if status >= 500:
            log.error("error handling a request from %s", request.remote, exc_info=exc)
        else:
            log.debug("refused a malformed request from %s: %s", request.remote, exc)
        if request.writer.output_size > 0:  # some of a response went out: nothing to add
            raise ConnectionError("Response is sent already, cannot send another response")
        error = protocol_error(status, exc, self.max_line_size)
        response = error.response()
        response.headers["x-request-id"] = uuid.uuid4().hex
        response.force_close()
        return response


class JsonErrorServer(web_server.Server):
    def __call__(self) -> JsonErrorRequestHandler:
        return JsonErrorRequestHandler(self, loop=self._loop, **self._kwargs)


class JsonErrorAppRunner(web.AppRunner):
    """`web.AppRunner` whose connections answer protocol errors as JSON (`HANDLER_ARGS` set the
    limits: pass them to `web.Application(handler_args=...)`)."""

    async def _make_server(self) -> web_server.Server:
        server = await super()._make_server()
        server.__class__ = JsonErrorServer  # the app builds a plain Server; only `__call__` differs
        return server
