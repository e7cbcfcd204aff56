"""Per-key and per-model limits nested under the tenant's, exact across three replicas sharing the
real Redis and PostgreSQL; concurrency leases of a replica that died expire by themselves; the
refusing limit is named in the response and in the audit record."""

from __future__ import annotations

import asyncio
import itertools

import pytest
from test_replica_apps_support import (
    REDIS_URL,
    admin_call,
    complete,
    new_key,
    new_tenant,
    replica_database,  # noqa: F401 (fixture)
    replicas,
    shared_engine,  # noqa: F401 (fixture)
    wait_for,
)

from gateway.redis_client import make_redis
from gateway.tenancy.admission import request_limits
from gateway.tenancy.ratelimit import RateLimiter

pytestmark = [pytest.mark.slow]


@pytest.fixture
async def three(replica_database, shared_engine, tiny_model_dir, tmp_path):  # noqa: F811
    async with replicas(3, replica_database, shared_engine, tiny_model_dir, tmp_path) as apps:
        yield apps


async def spray(apps, key: str, model: str, count: int, max_tokens: int = 1):
    """`count` completions at once, round-robin over the replicas."""
    calls = [complete(app, key, model, max_tokens)
             for app, _ in zip(itertools.cycle(apps), range(count))]  # fmt: skip
    return await asyncio.gather(*calls)


async def test_key_rpm_is_exact_across_replicas_under_the_tenants(three, unique_name,
                                                                  tiny_model_dir):  # fmt: skip
    model = tiny_model_dir.name
    tenant = await new_tenant(three[0], unique_name, rpm=7)
    narrow = await new_key(three[0], tenant["id"], limits={"rpm": 3})
    wide = await new_key(three[0], tenant["id"])
    outcomes = await spray(three, narrow["key"], model, 9)
    assert sorted(status for status, _, _ in outcomes) == [200] * 3 + [429] * 6
    refusal = next(body for status, body, _ in outcomes if status == 429)
    assert f"key {narrow['id']}" in refusal["error"]["message"]
    admitted_headers = [headers for status, _, headers in outcomes if status == 200]
    assert {h["x-ratelimit-limit-requests"] for h in admitted_headers} == {"3"}  # the tightest
    outcomes = await spray(three, wide["key"], model, 9)  # the tenant's 7 - 3 left
    statuses = sorted(status for status, _, _ in outcomes)
    assert statuses == [200] * 4 + [429] * 5
    refusal = next(body for status, body, _ in outcomes if status == 429)
    assert "(the limit of the tenant)" in refusal["error"]["message"]

    async def refused_records():
        status, page = await admin_call(
            three[0], "GET", f"/requests?tenant_id={tenant['id']}&status=rejected"
        )
        records = page["items"]  # fmt: skip
        return records if len(records) == 11 else None

    records = await wait_for(refused_records)
    assert records, "the refusals' audit records did not arrive"
    by = {record["key_id"]: record["refused_by"] for record in records}
    assert by == {narrow["id"]: f"key {narrow['id']}", wide["id"]: "tenant"}
    assert {record["refusal_reason"] for record in records} == {"rate_limit_requests"}
    by_key = next(record for record in records if record["key_id"] == narrow["id"])
    status, detail = await admin_call(three[0], "GET", f"/requests/{by_key['id']}")
    explanation = " ".join(detail["explanation"])
    assert f"key {narrow['id']}'s requests-per-minute limit" in explanation


async def open_streams(apps, key: str, model: str, count: int) -> list:
    """`count` streamed completions at once, round-robin over the replicas, each answered as far
    as its status and headers: an admitted one keeps generating (1,000 tokens: seconds) while the
    others are answered, however slowly a loaded machine runs this test's event loop. Holding
    48-token completions open instead admitted four of six once: the first two had finished."""
    body = {"model": model, "prompt": [100, 200, 300, 400], "max_tokens": 1000,
            "ignore_eos": True, "stream": True}  # fmt: skip
    headers = {"Authorization": f"Bearer {key}"}
    calls = [app.post("/v1/completions", json=body, headers=headers)
             for app, _ in zip(itertools.cycle(apps), range(count))]  # fmt: skip
    return await asyncio.gather(*calls)


async def test_key_concurrency_is_exact_across_replicas(three, unique_name, tiny_model_dir):
    model = tiny_model_dir.name
    tenant = await new_tenant(three[0], unique_name, max_concurrency=5)
    key = await new_key(three[0], tenant["id"], limits={"max_concurrency": 2})
    responses = await open_streams(three, key["key"], model, 6)
    statuses = sorted(response.status for response in responses)
    assert statuses.count(200) == 2 and statuses.count(429) == 4, statuses
    refused = next(response for response in responses if response.status == 429)
    message = (await refused.json())["error"]["message"]
    assert "concurrent" in message and f"key {key['id']}" in message
    for response in responses:  # the client leaves: the admitted requests are aborted
        response.close()

    async def slots_free_again() -> bool:  # no leak
        return (await complete(three[2], key["key"], model))[0] == 200

    assert await wait_for(slots_free_again, timeout_s=10.0)


async def test_a_tenants_model_limit_applies_to_that_model(three, unique_name, tiny_model_dir):
    model = tiny_model_dir.name
    tenant = await new_tenant(three[0], unique_name, model_limits={model: {"rpm": 2}})
    assert tenant["model_limits"] == {model: {"rpm": 2}}
    key = await new_key(three[0], tenant["id"])
    outcomes = await spray(three, key["key"], model, 4)
    assert sorted(status for status, _, _ in outcomes) == [200, 200, 429, 429]
    refusal = next(body for status, body, _ in outcomes if status == 429)
    assert f"tenant model {model}" in refusal["error"]["message"]


async def test_a_dead_replicas_concurrency_slots_are_released(unique_name):
    """A replica admits and dies before completing: its leases expire after their lifetime and
    the slots are free again, without anyone completing them."""
    from types import SimpleNamespace

    from gateway.tenancy.ratelimit import TenantLimits

    tenant = SimpleNamespace(name=unique_name, model_limits=None,
                             **{f: None for f in ("rpm", "tpm", "daily_token_quota",
                                                  "monthly_token_quota", "max_grammar_bytes")},
                             burst=0, max_concurrency=3)  # fmt: skip
    principal = SimpleNamespace(tenant=tenant, key_id=41, key=SimpleNamespace(
        limits={"max_concurrency": 1}))  # fmt: skip
    limits = request_limits(principal)
    assert isinstance(limits.scopes[0].limits, TenantLimits) and len(limits.scopes) == 2
    dying, alive = make_redis(REDIS_URL), make_redis(REDIS_URL)
    try:
        dead = RateLimiter(dying, lease_ttl_s=0.5)
        assert (await dead.admit(limits, "held-by-the-dead", 1, 1)).allowed
        await dying.aclose()  # the replica is gone: no complete, no renewal
        survivor = RateLimiter(alive, lease_ttl_s=0.5)
        refused = await survivor.admit(limits, "waits", 1, 1)
        assert not refused.allowed and refused.refused_by == "key 41"
        await asyncio.sleep(0.6)
        assert (await survivor.admit(limits, "after-expiry", 1, 1)).allowed
    finally:
        await alive.aclose()


async def test_a_rotation_does_not_reset_the_keys_limits(three, unique_name, tiny_model_dir):
    model = tiny_model_dir.name
    tenant = await new_tenant(three[0], unique_name)
    old = await new_key(three[0], tenant["id"], limits={"rpm": 2})
    assert [s for s, _, _ in await spray(three, old["key"], model, 2)] == [200, 200]
    status, new = await admin_call(three[1], "POST", f"/keys/{old['id']}/rotate",
                                   {"grace_seconds": 60})  # fmt: skip
    assert status == 201 and new["lineage_id"] == old["id"] and new["limits"] == {"rpm": 2}
    for key in (new["key"], old["key"]):  # one window for the old key and its successor
        status, body, _ = await complete(three[2], key, model)
        assert status == 429 and "(the limit of the key " in body["error"]["message"]
