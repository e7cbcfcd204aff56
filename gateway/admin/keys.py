"""API keys over the admin API: created (shown once), listed with their state, changed,
rotated with a grace period and revoked.

    POST   /admin/tenants/{tenant_id}/keys   KeyCreate (optional) -> 201 KeyCreated
    GET    /admin/tenants/{tenant_id}/keys   -> KeyList (states, scopes, limits; never keys)
    PATCH  /admin/keys/{key_id}              KeyPatch -> ApiKeyOut (409 once revoked)
    POST   /admin/keys/{key_id}/rotate       KeyRotate -> 201 KeyRotated (the new key, once)
    DELETE /admin/keys/{key_id}              -> ApiKeyOut (revoked)

Every change is announced to every replica once it has committed (`KeyChanges`): a revoked key
is refused everywhere from the next request on.
"""

from __future__ import annotations

from typing import Any

from aiohttp import web
from pydantic import BaseModel, Field, ValidationError
from sqlalchemy.orm.exc import StaleDataError

from gateway.admin.tenants import body_error, int_param, json_model, not_found, read_json
from gateway.appkeys import AUTHENTICATOR, SESSIONMAKER, SETTINGS
from gateway.errors import APIError
from gateway.jsonbody import read_raw
from gateway.tenancy.key_lifecycle import KeyNotRotatable, KeyRevoked, rotate_key, update_key
from gateway.tenancy.key_models import ApiKeyOut, KeyCreate, KeyPatch, KeyRotate
from gateway.tenancy.keys import ApiKeyNotFound, KeyHasher, create_key, list_keys, revoke_key
from gateway.tenancy.tenants import TenantNotFound


class KeyCreated(ApiKeyOut):
    key: str = Field(description="the API key; shown only in this response, never again")


class KeyRotated(KeyCreated):
    replaces: ApiKeyOut = Field(description="the old key: state rotated, until grace_ends_at")


class KeyList(BaseModel):
    items: list[ApiKeyOut]


async def announce_key_change(request: web.Request) -> None:
    """Forget cached keys here and tell every other replica (after the change committed)."""
    authenticator = request.config_dict.get(AUTHENTICATOR)
    if authenticator is not None:
        await authenticator.announce_change()


def hasher_of(request: web.Request) -> KeyHasher:
    return KeyHasher(request.config_dict[SETTINGS].effective_key_hash_secret)


async def read_optional(request: web.Request, model: type[BaseModel]) -> Any:
    """The body as `model`; no body at all: the model's defaults. A body of white space is a
    body, and not JSON: a 400 (schemathesis sent one space and got a key made from defaults)."""
    if not await read_raw(request):
        return model()
    return await read_json(request, model)


def conflict(message: str, code: str) -> APIError:
    return APIError(409, message, code=code)


def created(key: Any, plaintext: str) -> KeyCreated:
    return KeyCreated(**ApiKeyOut.model_validate(key).model_dump(), key=plaintext)


async def create_key_handler(request: web.Request) -> web.Response:
    tenant_id = int_param(request, "tenant_id")
    spec = await read_optional(request, KeyCreate)
    try:
        async with request.config_dict[SESSIONMAKER].begin() as session:
            key, plaintext = await create_key(session, tenant_id, hasher_of(request), spec)
            answer = created(key, plaintext)
    except TenantNotFound as error:
        raise not_found(error) from None
    except ValueError as error:  # expires_at and duration both given
        raise conflict(f"Conflicting fields: {error}", "conflicting_fields") from None
    return json_model(answer, status=201)


async def list_keys_handler(request: web.Request) -> web.Response:
    tenant_id = int_param(request, "tenant_id")
    try:
        async with request.config_dict[SESSIONMAKER]() as session:
            keys = [ApiKeyOut.model_validate(key) for key in await list_keys(session, tenant_id)]
    except TenantNotFound as error:
        raise not_found(error) from None
    return json_model(KeyList(items=keys))


async def update_key_handler(request: web.Request) -> web.Response:
    key_id = int_param(request, "key_id")
    patch = await read_json(request, KeyPatch)
    try:
        async with request.config_dict[SESSIONMAKER].begin() as session:
            key = ApiKeyOut.model_validate(await update_key(session, key_id, patch))
    except (ApiKeyNotFound, StaleDataError):
        raise APIError(404, f"no API key with id {key_id}", code="not_found") from None
    except KeyRevoked as error:
        raise conflict(str(error), "key_revoked") from None
    except ValidationError as error:
        raise body_error(error) from None
    except ValueError as error:
        raise conflict(f"Conflicting fields: {error}", "conflicting_fields") from None
    await announce_key_change(request)
    return json_model(key)


async def rotate_key_handler(request: web.Request) -> web.Response:
    key_id = int_param(request, "key_id")
    body = await read_optional(request, KeyRotate)
    try:
        async with request.config_dict[SESSIONMAKER].begin() as session:
            new, plaintext, old = await rotate_key(
                session, key_id, hasher_of(request), body.grace_seconds
            )
            answer = KeyRotated(
                **created(new, plaintext).model_dump(), replaces=ApiKeyOut.model_validate(old)
            )
    except (ApiKeyNotFound, StaleDataError):
        raise APIError(404, f"no API key with id {key_id}", code="not_found") from None
    except KeyNotRotatable as error:
        raise conflict(str(error), "key_not_rotatable") from None
    await announce_key_change(request)
    return json_model(answer, status=201)


async def revoke_key_handler(request: web.Request) -> web.Response:
    key_id = int_param(request, "key_id")
    try:
        async with request.config_dict[SESSIONMAKER].begin() as session:
            key = ApiKeyOut.model_validate(await revoke_key(session, key_id))
    except ApiKeyNotFound as error:
        raise not_found(error) from None
    except StaleDataError:  # its tenant (and so the key) was deleted meanwhile
        raise APIError(404, f"no API key with id {key_id}", code="not_found") from None
    await announce_key_change(request)
    return json_model(key)
