"""Reading a JSON request body into its pydantic model, with JSON's own idea of a number.

The published documents say `"type": "integer"`, and to JSON Schema `4.0` is an integer; to
pydantic's strict mode it is not. So the body is parsed first (no NaN or Infinity, no invalid
UTF-8, no lone surrogate), numbers with an integral value become ints, and the model is then
validated strictly: `4.0` is a fine `n`, `"4"` and `true` are not.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any, TypeVar

import pydantic_core
from aiohttp import web
from pydantic import BaseModel, ValidationError

from gateway.errors import APIError, bad_request, from_validation_error

Model = TypeVar("Model", bound=BaseModel)

BODY_READ_TIMEOUT_S = 30.0  # a body that does not arrive (shorter than its Content-Length): 408


def integral_numbers_as_ints(value: Any) -> Any:
    if isinstance(value, float) and value.is_integer():
        return int(value)
    if isinstance(value, list):
        return [integral_numbers_as_ints(item) for item in value]
    if isinstance(value, dict):
        return {key: integral_numbers_as_ints(item) for key, item in value.items()}
    return value


def parse_json(raw: bytes) -> Any:
    if not raw.strip():
        raise bad_request("The request body is empty; send a JSON object.")
    try:
        return integral_numbers_as_ints(pydantic_core.from_json(raw, allow_inf_nan=False))
    except ValueError as error:
        raise bad_request(f"We could not parse the JSON body of your request: {error}") from None


async def read_raw(request: web.Request) -> bytes:
    """The body; over the app's client_max_size aiohttp raises 413."""
    try:
        return await asyncio.wait_for(request.read(), BODY_READ_TIMEOUT_S)
    except asyncio.TimeoutError:
        message = f"The request body did not arrive within {BODY_READ_TIMEOUT_S:g} s."
        raise APIError(408, message, code="request_timeout", close_connection=True) from None


async def read_model(
    request: web.Request,
    model: type[Model],
    error_of: Callable[[ValidationError], APIError] = from_validation_error,
) -> Model:
    data = parse_json(await read_raw(request))
    try:
        return model.model_validate(data, strict=True)
    except ValidationError as error:
        raise error_of(error) from None
