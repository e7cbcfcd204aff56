"""Three `conveyor serve` replicas (the tiny random Llama) sharing the real Redis and one fresh
PostgreSQL schema, deployed as the Helm chart does it: `conveyor db upgrade` first (the
migration Job), then replicas that neither migrate nor create a demo tenant.

Shown: request-rate limits and token quotas are global (a tenant spraying requests round-robin
or all at once gets exactly rpm + burst in a minute, no more than one replica would give it),
the rate-limit headers count what is left across replicas, the three replicas write one audit log, and a key
revoked with `conveyor keys revoke` stops working on every replica within 5 s.

Redis or PostgreSQL being down fails these tests; they never skip."""

from __future__ import annotations

import asyncio
import collections
import itertools
import math
import os
import subprocess
import sys
import time

import openai
import pytest
import redis
from test_db_support import temporary_database
from test_server_support import (
    KEY_HASH_SECRET,
    REPO_ROOT,
    ServerProcess,
    audit_records_of,
    create_tenant_with_key,
    real_service_urls,
    server_env,
    serving,
    tiny_engine_args,
)

pytestmark = [pytest.mark.slow]

REDIS_URL, POSTGRES_URL = real_service_urls()
NUM_REPLICAS = 3
BURST = 2
PROMPT = [100, 200, 300, 400]  # token ids: exactly 4 prompt tokens
REVOCATION_DEADLINE_S = 5.0


# ---- the replicas ----------------------------------------------------------------------------
def conveyor(*args: str, database_url: str) -> subprocess.CompletedProcess:
    """The `conveyor` CLI as an operator (or the chart's migration Job) runs it."""
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT)}
    command = [sys.executable, "-m", "gateway.cli", *args, "--database-url", database_url]
    return subprocess.run(command, env=env, capture_output=True, text=True, timeout=120)


@pytest.fixture(scope="module")
def replicas(tmp_path_factory, tiny_model_dir):
    with redis.Redis.from_url(REDIS_URL, socket_connect_timeout=2) as client:
        client.ping()  # raises (and so fails the tests) when Redis is down
    root = tmp_path_factory.mktemp("replicas")
    with temporary_database("postgresql", root, POSTGRES_URL) as database_url:
        migrated = conveyor("db", "upgrade", database_url=database_url)
        assert migrated.returncode == 0, migrated.stderr
        servers = [start_replica(root / f"replica{i}", database_url, tiny_model_dir) for i in range(NUM_REPLICAS)]  # fmt: skip
        with serving(*servers):
            yield servers


def start_replica(workdir, database_url: str, model_dir) -> ServerProcess:
    workdir.mkdir()
    env = server_env(database_url, REDIS_URL, workdir)
    env |= {
        "CONVEYOR_AUTO_MIGRATE": "false",  # the migration Job did it
        "CONVEYOR_CREATE_DEMO_TENANT": "false",
        "CONVEYOR_DRAIN_TIMEOUT": "5",
    }
    args = tiny_engine_args(model_dir)
    return ServerProcess(workdir, env, args, database_url=database_url).start()


def clients_for(servers: list[ServerProcess], key: str) -> list[openai.AsyncOpenAI]:
    return [
        openai.AsyncOpenAI(base_url=server.base_url + "/v1", api_key=key, max_retries=0)
        for server in servers
    ]


async def close_all(clients: list[openai.AsyncOpenAI]) -> None:
    await asyncio.gather(*(client.close() for client in clients))


async def new_tenant(database_url: str, name: str, **limits) -> str:
    return await asyncio.to_thread(create_tenant_with_key, database_url, name, **limits)


async def send(client: openai.AsyncOpenAI, model: str, max_tokens: int) -> tuple[str, object]:
    """("ok", completion) or (status, error); either way with its request id."""
    try:
        completion = await client.completions.create(
            model=model, prompt=PROMPT, max_tokens=max_tokens, extra_body={"ignore_eos": True}
        )
    except openai.APIStatusError as error:
        return str(error.status_code), error
    return "ok", completion


def request_id_of(outcome: tuple[str, object]) -> str:
    kind, value = outcome
    if kind == "ok":
        return value.id.removeprefix("cmpl-")
    return value.response.headers["x-request-id"]


async def wait_for_audit(database_url: str, tenant: str, count: int, timeout_s: float = 15.0):
    """The tenant's audit records once `count` are in (writers flush in batches)."""
    deadline = time.monotonic() + timeout_s
    while True:
        records = await asyncio.to_thread(audit_records_of, database_url, tenant)
        if len(records) >= count or time.monotonic() > deadline:
            return records
        await asyncio.sleep(0.2)


# ---- global limits -----------------------------------------------------------------------------
async def test_request_rate_is_limited_globally(replicas, tiny_model_dir, unique_name):
    rpm = 6
    database_url = replicas[0].database_url
    key = await new_tenant(database_url, unique_name, rpm=rpm, burst=BURST)
    clients = clients_for(replicas, key)
    started = time.monotonic()
    try:
        outcomes = []
        for client in itertools.islice(itertools.cycle(clients), 8 * NUM_REPLICAS):
            outcomes.append(await send(client, tiny_model_dir.name, max_tokens=1))
    finally:
        await close_all(clients)
    assert time.monotonic() - started < 60  # all in one window
    # Per-replica limits would admit rpm + BURST on each replica: 24 > rpm + BURST = 8.
    assert [kind for kind, _ in outcomes] == ["ok"] * (rpm + BURST) + ["429"] * 16
    refused = outcomes[rpm + BURST :]
    for _, error in refused:
        assert error.code == "rate_limit_exceeded"
        assert 1 <= int(error.response.headers["Retry-After"]) <= 60
        assert error.response.headers["x-ratelimit-remaining-requests"] == "0"
    # one audit log: every request, admitted or refused, whichever replica took it
    records = await wait_for_audit(database_url, unique_name, len(outcomes))
    by_id = {record["id"]: record for record in records}
    assert sorted(by_id) == sorted(request_id_of(o) for o in outcomes)
    for outcome in refused:
        record = by_id[request_id_of(outcome)]
        assert (record["status"], record["refusal_reason"]) == ("rejected", "rate_limit_requests")


async def test_requests_sprayed_at_once_get_exactly_rpm_across_replicas(
    replicas, tiny_model_dir, unique_name
):
    rpm = 5
    key = await new_tenant(replicas[0].database_url, unique_name, rpm=rpm)
    clients = clients_for(replicas, key)
    try:
        sends = [send(clients[i % NUM_REPLICAS], tiny_model_dir.name, 1) for i in range(18)]
        outcomes = await asyncio.gather(*sends)
    finally:
        await close_all(clients)
    kinds = collections.Counter(kind for kind, _ in outcomes)
    assert kinds == {"ok": rpm, "429": len(outcomes) - rpm}  # burst 0: no extra


async def test_headers_count_what_is_left_across_replicas(replicas, tiny_model_dir, unique_name):
    key = await new_tenant(replicas[0].database_url, unique_name, rpm=600, tpm=10_000)
    clients = clients_for(replicas, key)
    try:
        replies = [
            await client.completions.with_raw_response.create(
                model=tiny_model_dir.name, prompt=PROMPT, max_tokens=6
            )
            for client in clients
        ]
    finally:
        await close_all(clients)
    headers = [reply.headers for reply in replies]
    assert [h["x-ratelimit-limit-requests"] for h in headers] == ["600"] * NUM_REPLICAS
    assert [h["x-ratelimit-remaining-requests"] for h in headers] == ["599", "598", "597"]
    assert [h["x-ratelimit-reset-requests"] for h in headers] == ["0s"] * NUM_REPLICAS
    assert [h["x-ratelimit-limit-tokens"] for h in headers] == ["10000"] * NUM_REPLICAS
    # each reserved prompt + max_tokens = 10 (its unused part comes back at completion)
    remaining_tokens = [int(h["x-ratelimit-remaining-tokens"]) for h in headers]
    assert remaining_tokens[0] == 10_000 - 10
    assert all(10_000 - 10 * (i + 1) <= r <= 10_000 - 10 for i, r in enumerate(remaining_tokens))


async def test_token_quota_is_never_overshot_across_replicas(replicas, tiny_model_dir, unique_name):
    max_tokens = 20
    reserved = len(PROMPT) + max_tokens  # what each request holds while it runs
    quota = 200
    database_url = replicas[0].database_url
    key = await new_tenant(database_url, unique_name, daily_token_quota=quota)
    clients = clients_for(replicas, key)
    try:
        sends = [
            send(clients[i % NUM_REPLICAS], tiny_model_dir.name, max_tokens) for i in range(24)
        ]
        outcomes = await asyncio.gather(*sends)  # all at once, spread over the replicas
    finally:
        await close_all(clients)
    admitted = [value for kind, value in outcomes if kind == "ok"]
    refused = [value for kind, value in outcomes if kind != "ok"]
    used = sum(completion.usage.total_tokens for completion in admitted)
    assert used <= quota
    assert len(admitted) == quota // reserved  # nothing refunded: each used all it reserved
    assert refused and all(error.code == "insufficient_quota" for error in refused)
    records = await wait_for_audit(database_url, unique_name, len(outcomes))
    assert sorted(r["id"] for r in records) == sorted(request_id_of(o) for o in outcomes)
    finished = [r for r in records if r["status"] == "finished"]
    assert sum(r["prompt_tokens"] + r["completion_tokens"] for r in finished) == used


async def test_every_replica_writes_the_one_audit_log(replicas, tiny_model_dir, unique_name):
    database_url = replicas[0].database_url
    key = await new_tenant(database_url, unique_name)
    clients = clients_for(replicas, key)
    try:
        sent = {
            server.port: [await send(client, tiny_model_dir.name, 2) for _ in range(3)]
            for server, client in zip(replicas, clients)
        }
    finally:
        await close_all(clients)
    ids = {port: [request_id_of(o) for o in outcomes] for port, outcomes in sent.items()}
    assert all(kind == "ok" for outcomes in sent.values() for kind, _ in outcomes)
    records = await wait_for_audit(database_url, unique_name, 3 * NUM_REPLICAS)
    in_db = {record["id"] for record in records}
    for port, request_ids in ids.items():
        assert set(request_ids) <= in_db, f"replica on port {port} lost records"
    assert len(in_db) == 3 * NUM_REPLICAS


# ---- revocation -----------------------------------------------------------------------------------
async def test_a_revoked_key_stops_working_on_every_replica_within_5_s(replicas, unique_name):
    database_url = replicas[0].database_url
    key = await new_tenant(database_url, unique_name)
    clients = clients_for(replicas, key)
    try:
        for client in clients:  # every replica now has the key in its cache
            await client.models.list()
        revoked = await asyncio.to_thread(
            conveyor, "keys", "revoke", key, "--key-hash-secret", KEY_HASH_SECRET,
            database_url=database_url,
        )  # fmt: skip
        revoked_at = time.monotonic()
        assert revoked.returncode == 0, revoked.stderr
        latencies = await asyncio.gather(*(time_until_refused(client) for client in clients))
    finally:
        await close_all(clients)
    assert max(latencies) - revoked_at <= REVOCATION_DEADLINE_S, latencies


async def time_until_refused(client: openai.AsyncOpenAI) -> float:
    """When the key is first refused (401) by this replica; gives up after the deadline + 5 s."""
    deadline = time.monotonic() + REVOCATION_DEADLINE_S + 5.0
    while time.monotonic() < deadline:
        try:
            await client.models.list()
        except openai.AuthenticationError:
            return time.monotonic()
        await asyncio.sleep(0.1)
    return math.inf
