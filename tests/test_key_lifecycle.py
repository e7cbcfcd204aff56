"""Keys that live like credentials, over two or three replicas (in-process apps sharing the real
Redis and PostgreSQL): expiry, rotation with a grace period, revocation pushed to every replica
within one second, changes, listing states, and model and endpoint scopes."""

from __future__ import annotations

import asyncio
import time
from datetime import datetime, timedelta, timezone

import pytest
from pydantic import ValidationError
from test_replica_apps_support import (
    admin_call,
    complete,
    new_key,
    new_tenant,
    replica_database,  # noqa: F401 (fixture)
    replicas,
    shared_engine,  # noqa: F401 (fixture)
    wait_for,
)

from gateway.tenancy.key_models import KeyCreate

pytestmark = [pytest.mark.slow]


@pytest.fixture
async def two(replica_database, shared_engine, tiny_model_dir, tmp_path):  # noqa: F811
    async with replicas(2, replica_database, shared_engine, tiny_model_dir, tmp_path) as apps:
        yield apps


def iso(moment: datetime) -> str:
    return moment.isoformat().replace("+00:00", "Z")


async def test_an_expired_key_is_refused_saying_it_expired(two, unique_name, tiny_model_dir):
    model = tiny_model_dir.name
    tenant = await new_tenant(two[0], unique_name)
    past = iso(datetime.now(timezone.utc) - timedelta(seconds=1))
    expired = await new_key(two[0], tenant["id"], name="old", expires_at=past)
    fresh = await new_key(two[0], tenant["id"], duration="30d")
    status, body, _ = await complete(two[1], expired["key"], model)
    assert status == 401 and body["error"]["code"] == "expired_api_key"
    assert "expired" in body["error"]["message"] and "invalid" not in body["error"]["message"]
    assert (await complete(two[1], fresh["key"], model))[0] == 200
    assert expired["state"] == "expired" and fresh["state"] == "active"


async def test_a_rotated_key_works_during_its_grace_only(two, unique_name, tiny_model_dir):
    model = tiny_model_dir.name
    tenant = await new_tenant(two[0], unique_name)
    old = await new_key(two[0], tenant["id"], name="ci", models=[model])
    assert (await complete(two[1], old["key"], model))[0] == 200  # cached on replica 1
    status, rotated = await admin_call(two[0], "POST", f"/keys/{old['id']}/rotate",
                                       {"grace_seconds": 1})  # fmt: skip
    assert status == 201 and rotated["key"] != old["key"]
    assert rotated["name"] == "ci" and rotated["models"] == [model]
    assert rotated["replaces"]["state"] == "rotated"
    assert rotated["replaces"]["replaced_by_id"] == rotated["id"]
    for replica in two:
        assert (await complete(replica, old["key"], model))[0] == 200  # the grace
        assert (await complete(replica, rotated["key"], model))[0] == 200
    grace_end = datetime.fromisoformat(rotated["replaces"]["grace_ends_at"])
    await asyncio.sleep(max(0.0, (grace_end - datetime.now(timezone.utc)).total_seconds()) + 0.05)
    for replica in two:
        status, body, _ = await complete(replica, old["key"], model)
        assert status == 401 and "grace period ended" in body["error"]["message"]
        assert (await complete(replica, rotated["key"], model))[0] == 200
    again = await admin_call(two[0], "POST", f"/keys/{old['id']}/rotate")
    assert again[0] == 409


async def test_a_revoked_key_is_refused_by_the_other_replica_within_a_second(
    two, unique_name, tiny_model_dir
):
    model = tiny_model_dir.name
    tenant = await new_tenant(two[0], unique_name)
    key = await new_key(two[0], tenant["id"])
    assert (await complete(two[1], key["key"], model))[0] == 200  # replica 1 caches it
    status, revoked = await admin_call(two[0], "DELETE", f"/keys/{key['id']}")
    assert status == 200 and revoked["state"] == "revoked"
    started = time.monotonic()

    async def refused():
        return (await complete(two[1], key["key"], model))[0] == 401

    assert await wait_for(refused, timeout_s=1.0, interval_s=0.05)
    assert time.monotonic() - started < 1.0
    for method, path, body in (("PATCH", "", {"name": "x"}), ("POST", "/rotate", None)):
        status, answer = await admin_call(two[0], method, f"/keys/{key['id']}{path}", body)
        assert status == 409, answer  # revoked stays revoked, as it was
    listed = await admin_call(two[0], "GET", f"/tenants/{tenant['id']}/keys")
    assert [k["name"] for k in listed[1]["items"]] == [key["name"]]


async def test_patch_changes_scopes_and_expiry_on_every_replica(two, unique_name, tiny_model_dir):
    model = tiny_model_dir.name
    tenant = await new_tenant(two[0], unique_name)
    key = await new_key(two[0], tenant["id"])
    assert (await complete(two[1], key["key"], model))[0] == 200
    status, changed = await admin_call(two[0], "PATCH", f"/keys/{key['id']}",
                                       {"name": "narrow", "models": ["other-*"]})  # fmt: skip
    assert status == 200 and changed["models"] == ["other-*"] and changed["name"] == "narrow"
    status, body, _ = await complete(two[1], key["key"], model)
    assert status == 403 and body["error"]["code"] == "model_not_allowed"
    soon = iso(datetime.now(timezone.utc) + timedelta(days=2))
    status, changed = await admin_call(two[0], "PATCH", f"/keys/{key['id']}",
                                       {"models": None, "expires_at": soon})  # fmt: skip
    assert status == 200 and changed["state"] == "expiring"
    assert (await complete(two[1], key["key"], model))[0] == 200
    status, changed = await admin_call(two[0], "PATCH", f"/keys/{key['id']}", {"duration": "1s"})
    await asyncio.sleep(1.05)
    assert (await complete(two[1], key["key"], model))[0] == 401


async def test_listing_shows_states_last_use_scopes_and_limits(two, unique_name, tiny_model_dir):
    model = tiny_model_dir.name
    tenant = await new_tenant(two[0], unique_name)
    past = iso(datetime.now(timezone.utc) - timedelta(hours=1))
    active = await new_key(two[0], tenant["id"], endpoints=["completions"], limits={"rpm": 5})
    expiring = await new_key(two[0], tenant["id"], duration="3d")
    expired = await new_key(two[0], tenant["id"], expires_at=past)
    revoked = await new_key(two[0], tenant["id"])
    rotated = await new_key(two[0], tenant["id"])
    await admin_call(two[0], "DELETE", f"/keys/{revoked['id']}")
    await admin_call(two[0], "POST", f"/keys/{rotated['id']}/rotate", {"grace_seconds": 600})
    assert (await complete(two[1], active["key"], model))[0] == 200

    async def listing():
        status, page = await admin_call(two[0], "GET", f"/tenants/{tenant['id']}/keys")
        keys = {key["id"]: key for key in page["items"]}
        return keys if keys[active["id"]]["last_used_at"] else None

    keys = await wait_for(listing, timeout_s=5.0)
    assert keys, "last_used_at was never written"
    states = {key_id: key["state"] for key_id, key in keys.items()}
    assert states[active["id"]] == "active" and states[expiring["id"]] == "expiring"
    assert states[expired["id"]] == "expired" and states[revoked["id"]] == "revoked"
    assert states[rotated["id"]] == "rotated" and keys[rotated["id"]]["grace_ends_at"]
    assert keys[active["id"]]["endpoints"] == ["completions"]
    assert keys[active["id"]]["limits"] == {"rpm": 5}


async def test_models_and_endpoints_outside_the_scope_are_403(two, unique_name, tiny_model_dir):
    model = tiny_model_dir.name
    tenant = await new_tenant(two[0], unique_name)
    key = await new_key(two[0], tenant["id"], models=["nope-*"], endpoints=["chat.completions"])
    status, body, _ = await complete(two[1], key["key"], model)  # /v1/completions
    assert status == 403 and body["error"]["code"] == "endpoint_not_allowed"
    assert "completions" in body["error"]["message"]
    status, body, _ = await complete(two[1], key["key"], model, path="/v1/chat/completions")
    assert status == 403 and body["error"]["code"] == "model_not_allowed"
    assert body["error"]["param"] == "model" and "nope-*" in body["error"]["message"]
    globbed = await new_key(two[0], tenant["id"], models=[model[:3] + "*"])
    assert (await complete(two[1], globbed["key"], model))[0] == 200


async def test_the_model_list_shows_only_the_keys_models(two, unique_name, tiny_model_dir):
    tenant = await new_tenant(two[0], unique_name)
    narrow = await new_key(two[0], tenant["id"], models=["nope-*"])
    globbed = await new_key(two[0], tenant["id"], models=[tiny_model_dir.name[:3] + "*"])
    seen = []
    for key in (narrow, globbed):
        response = await two[1].get("/v1/models", headers={"Authorization": f"Bearer {key['key']}"})
        seen.append([card["id"] for card in (await response.json())["data"]])
    assert seen == [[], [tiny_model_dir.name]]


@pytest.mark.parametrize("duration", ["582109w", "100000d", "0d", "30y", "1.5h"])
def test_a_duration_past_what_a_date_holds_is_refused_as_invalid(duration):
    with pytest.raises(ValidationError):
        KeyCreate.model_validate({"duration": duration})


def test_the_longest_durations_still_give_a_date():
    now = datetime.now(timezone.utc)
    for duration in ("99999d", "9999w", "99999h"):
        assert KeyCreate.model_validate({"duration": duration}).expiry(now) > now
