"""A key's scopes: the models (served names or glob patterns) and the inference endpoints it may
call. Outside them: a 403, OpenAI-shaped, naming the scope. No scope given: everything.
"""

from __future__ import annotations

from fnmatch import fnmatchcase
from typing import Any

from gateway.errors import APIError

PERMISSION_ERROR = "permission_error"


ENDPOINT_OF_PATH = {
    "/v1/completions": "completions",
    "/v1/chat/completions": "chat.completions",
    "/v1/models": "models",
}


SCOPE_REFUSALS = ("model_not_allowed", "endpoint_not_allowed")  # the error codes


def endpoint_of(path: str) -> str | None:
    """The inference endpoint a path calls; None for the others (e.g. a request's timeline)."""
    if path.startswith("/v1/models/"):
        return "models"
    return ENDPOINT_OF_PATH.get(path.rstrip("/") or path)


def can_use_model(key: Any, model: str) -> bool:
    patterns = getattr(key, "models", None)
    return patterns is None or any(fnmatchcase(model, pattern) for pattern in patterns)


def can_call_endpoint(key: Any, endpoint: str | None) -> bool:
    endpoints = getattr(key, "endpoints", None)
    return endpoint is None or endpoints is None or endpoint in endpoints


def check_endpoint(key: Any, path: str) -> None:
    endpoint = endpoint_of(path)
    if not can_call_endpoint(key, endpoint):
        allowed = ", ".join(key.endpoints) or "none"
        raise APIError(
            403,
            f"This API key may not call the endpoint {endpoint!r} (its endpoints scope: "
            f"{allowed}).",
            type=PERMISSION_ERROR,
            code="endpoint_not_allowed",
        )


def check_model_scope(key: Any, model: str) -> None:
    if not can_use_model(key, model):
        allowed = ", ".join(key.models) or "none"
        raise APIError(
            403,
            f"This API key may not use the model {model!r} (its models scope: {allowed}).",
            type=PERMISSION_ERROR,
            param="model",
            code="model_not_allowed",
        )
