"""The control plane end to end over HTTP, on two real `conveyor serve` processes:

- `sqlite`: embedded defaults (SQLite file, fakeredis) with a tiny KV cache (12 blocks of 16
  tokens, 2 running sequences, forced swap) so that a priority-0 request preempts a running one;
- `postgresql`: the real PostgreSQL and the real Redis, each reached through a TCP proxy the
  tests can cut and restore (a database outage, a Redis outage).

The admin API (tenants, keys, usage, engine, audit queries, cancel), the OpenAPI documents
against real traffic, tenant isolation, metrics, health, the explanation of a forced
preemption, and an outage that ends with every audit record stored exactly once.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import json
import threading
import time
import urllib.error
import urllib.request
import uuid
from datetime import datetime
from pathlib import Path

import psycopg
import pytest
from jsonschema import Draft202012Validator
from prometheus_client.parser import text_string_to_metric_families
from sqlalchemy.engine import make_url
from test_db_support import ToggleProxy, temporary_database, with_port
from test_server_support import (
    ADMIN_TOKEN,
    ENGINE_ARGS,
    MODEL_NAME,
    ServerProcess,
    real_service_urls,
    server_env,
    serving,
)

pytestmark = [pytest.mark.slow, pytest.mark.real_model]

REDIS_URL, POSTGRES_URL = real_service_urls()
TINY_KV_ARGS = [
    "--num-kv-blocks", "12", "--max-num-seqs", "2", "--preemption-mode", "swap",
    "--swap-space", "0.05", "--max-model-len", "192",
]  # fmt: skip
LONG_PROMPT = " ".join(["garden river music light water"] * 29)  # ~146 tokens: 10 KV blocks


# ---- HTTP helpers ------------------------------------------------------------------------------
class Reply:
    def __init__(self, status: int, headers, raw: bytes) -> None:
        self.status, self.headers, self.raw = status, headers, raw

    @property
    def body(self):
        return json.loads(self.raw) if self.raw else None

    @property
    def request_id(self) -> str:
        return self.headers["x-request-id"]


def call(server, method: str, path: str, token=None, body=None, timeout_s=60.0) -> Reply:
    data = json.dumps(body).encode() if body is not None else None
    headers = {"Content-Type": "application/json"}
    if token is not None:
        headers["Authorization"] = f"Bearer {token}"
    request = urllib.request.Request(server.base_url + path, data, headers, method=method)
    try:
        with urllib.request.urlopen(request, timeout=timeout_s) as response:
            return Reply(response.status, response.headers, response.read())
    except urllib.error.HTTPError as error:
        with error:
            return Reply(error.code, error.headers, error.read())


def admin(server, method: str, path: str, body=None) -> Reply:
    return call(server, method, "/admin" + path, ADMIN_TOKEN, body)


def complete(server, key: str, prompt="Hello", max_tokens=2, **fields) -> Reply:
    body = {"model": MODEL_NAME, "prompt": prompt, "max_tokens": max_tokens, **fields}
    return call(server, "POST", "/v1/completions", key, body)


def new_tenant(server, **fields) -> tuple[dict, str]:
    """A tenant with a unique name (Redis keys outlive test runs) and one key."""
    name = fields.pop("name", f"t-{uuid.uuid4().hex[:10]}")
    created = admin(server, "POST", "/tenants", {"name": name, **fields})
    assert created.status == 201, created.raw
    key = admin(server, "POST", f"/tenants/{created.body['id']}/keys")
    assert key.status == 201, key.raw
    return created.body, key.body["key"]


def audit_detail(server, request_id: str, token=ADMIN_TOKEN, timeout_s=10.0) -> Reply:
    """The request's audit detail once the writer has stored it (it batches every 0.2 s)."""
    path = ("/admin" if token == ADMIN_TOKEN else "/v1") + f"/requests/{request_id}"
    deadline = time.monotonic() + timeout_s
    while True:
        reply = call(server, "GET", path, token)
        if reply.status != 404 or time.monotonic() > deadline:
            return reply
        time.sleep(0.1)


def metric_values(server) -> dict[tuple[str, tuple], float]:
    reply = call(server, "GET", "/metrics")
    assert reply.status == 200
    assert reply.headers["Content-Type"].startswith("text/plain")
    return {
        (sample.name, tuple(sorted(sample.labels.items()))): sample.value
        for family in text_string_to_metric_families(reply.raw.decode())
        for sample in family.samples
    }


def record_delay_s(record: dict) -> float:
    """The delay the audit row itself records: received -> first scheduled, plus preempted."""
    received = datetime.fromisoformat(record["received_at"])
    scheduled = datetime.fromisoformat(record["first_scheduled_at"])
    return (scheduled - received).total_seconds() + record["preempted_time_s"]


# ---- the servers -------------------------------------------------------------------------------
class BackgroundProxy:
    """`ToggleProxy` on its own event loop thread, for synchronous tests."""

    def __init__(self, host: str, port: int) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        self.proxy = ToggleProxy(host, port)
        self.run(self.proxy.start())

    @property
    def port(self) -> int:
        return self.proxy.port

    def run(self, coroutine):
        return asyncio.run_coroutine_threadsafe(coroutine, self.loop).result(timeout=10)

    def cut(self) -> None:
        self.run(self.proxy.cut())

    def restore(self) -> None:
        self.run(self.proxy.restore())

    def close(self) -> None:
        self.run(self._shutdown())
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(timeout=10)
        self.loop.close()

    async def _shutdown(self) -> None:
        if self.proxy._server is not None and self.proxy._server.is_serving():
            await self.proxy.close()
        await self.proxy.cut_connections()
        others = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
        for task in others:
            task.cancel()
        await asyncio.gather(*others, return_exceptions=True)


def start_server(workdir: Path, database_url: str, redis_url, args) -> ServerProcess:
    env = server_env(database_url, redis_url, workdir)
    return ServerProcess(workdir, env, args, database_url=database_url).start()


@pytest.fixture(scope="module")
def sqlite_server(tmp_path_factory):
    workdir = tmp_path_factory.mktemp("admin-sqlite")
    server = start_server(workdir, f"sqlite:///{workdir / 'conveyor.db'}", None, TINY_KV_ARGS)
    with serving(server):
        yield server


@pytest.fixture(scope="module")
def postgres_proxies():
    postgres = make_url(POSTGRES_URL)
    redis = make_url(REDIS_URL)
    proxies = (
        BackgroundProxy(postgres.host or "127.0.0.1", postgres.port or 5432),
        BackgroundProxy(redis.host or "127.0.0.1", redis.port or 6379),
    )
    yield proxies
    for proxy in proxies:
        proxy.close()


@pytest.fixture(scope="module")
def postgres_server(tmp_path_factory, postgres_proxies):
    workdir = tmp_path_factory.mktemp("admin-postgres")
    pg_proxy, redis_proxy = postgres_proxies
    with temporary_database("postgresql", workdir, POSTGRES_URL) as direct_url:
        url = with_port(direct_url, pg_proxy.port)
        redis_url = f"redis://127.0.0.1:{redis_proxy.port}/0"
        server = start_server(workdir, url, redis_url, ENGINE_ARGS)
        server.direct_database_url = direct_url  # bypasses the proxy, for checks
        with serving(server):
            yield server


@pytest.fixture(params=["sqlite", "postgres"], scope="module")
def server(request):
    return request.getfixturevalue(f"{request.param}_server")


# ---- authentication ----------------------------------------------------------------------------
def test_admin_tokens_tenant_keys_and_no_token(server):
    _, key = new_tenant(server)
    assert call(server, "GET", "/admin/tenants").status == 401
    assert call(server, "GET", "/admin/tenants", "not-a-token").status == 401
    refused = call(server, "GET", "/admin/tenants", key)
    assert refused.status == 403
    assert refused.body["error"]["code"] == "not_an_admin_token"
    assert admin(server, "GET", "/tenants").status == 200
    assert call(server, "GET", "/v1/models", ADMIN_TOKEN).status == 401  # no tenant rights


# ---- tenants and keys --------------------------------------------------------------------------
def test_tenant_crud(server):
    name = f"crud-{uuid.uuid4().hex[:8]}"
    tenant, _ = new_tenant(server, name=name, rpm=600, default_priority=3, max_priority=1)
    assert tenant["rpm"] == 600 and tenant["max_priority"] == 1 and tenant["enabled"] is True
    tenant_id = tenant["id"]
    assert admin(server, "POST", "/tenants", {"name": name}).status == 409
    bad = admin(server, "POST", "/tenants", {"name": "x-" + name, "max_priority": 5})
    assert bad.status == 409 and "max_priority" in bad.body["error"]["message"]
    assert bad.body["error"]["code"] == "conflicting_fields"
    assert admin(server, "POST", "/tenants", {"name": "y-" + name, "color": "red"}).status == 400
    assert any(t["id"] == tenant_id for t in admin(server, "GET", "/tenants").body["items"])
    assert admin(server, "GET", f"/tenants/{tenant_id}").body["name"] == name
    patched = admin(server, "PATCH", f"/tenants/{tenant_id}", {"rpm": None, "weight": 2.5})
    assert patched.status == 200, patched.raw
    assert patched.body["rpm"] is None and patched.body["weight"] == 2.5
    assert patched.body["default_priority"] == 3  # untouched
    assert admin(server, "PATCH", f"/tenants/{tenant_id}", {"max_priority": 9}).status == 409
    assert admin(server, "PATCH", f"/tenants/{tenant_id}", {"rpm": 0}).status == 400
    assert tenant["burst"] == 0  # no extra unless set
    with_burst = admin(server, "PATCH", f"/tenants/{tenant_id}", {"burst": 5})
    assert with_burst.status == 200 and with_burst.body["burst"] == 5
    for bad_burst in (-1, None, "many"):
        assert admin(server, "PATCH", f"/tenants/{tenant_id}", {"burst": bad_burst}).status == 400
    assert admin(server, "DELETE", f"/tenants/{tenant_id}").status == 204
    assert admin(server, "GET", f"/tenants/{tenant_id}").status == 404
    assert admin(server, "GET", "/tenants/abc").status == 404
    assert admin(server, "DELETE", f"/tenants/{tenant_id}").status == 404


@pytest.mark.parametrize(
    "method, path",
    [
        ("GET", "/tenants/6668985349892447482029277184"),
        ("DELETE", "/keys/42255808085988200153088"),
        ("PATCH", "/tenants/2147483648"),
        ("POST", "/tenants/%C2%B2/keys"),  # a digit, but not an ASCII one
        ("GET", "/tenants/-1/usage"),
        ("GET", "/requests/%00"),
        ("GET", "/requests/" + "a" * 500),
    ],
)
def test_ids_out_of_range_are_404_before_sql(server, method, path):
    reply = admin(server, method, path, {} if method == "PATCH" else None)
    assert reply.status == 404, reply.raw
    assert reply.body["error"]["code"] == "not_found"


@pytest.mark.parametrize(
    "body, param",
    [
        ({"name": "strict-a", "enabled": "no"}, "enabled"),
        ({"name": "strict-b", "enabled": 0}, "enabled"),
        ({"name": "strict-c", "rpm": "60"}, "rpm"),
        ({"name": "strict-d", "weight": "2"}, "weight"),
    ],
)
def test_tenant_fields_are_strict(server, body, param):
    reply = admin(server, "POST", "/tenants", body)
    assert reply.status == 400, reply.raw
    assert reply.body["error"]["param"] == param


@pytest.mark.parametrize(
    "query", ["priority=14047560797637867520", "tenant_id=99999999999", "status=", "status=x"]
)
def test_audit_filters_out_of_range_are_400(server, query):
    reply = admin(server, "GET", f"/requests?{query}")
    assert reply.status == 400, reply.raw


def test_keys_are_shown_once_and_revoking_or_disabling_takes_effect(server):
    tenant, key = new_tenant(server)
    assert call(server, "GET", "/v1/models", key).status == 200
    keys = admin(server, "GET", f"/tenants/{tenant['id']}/keys").body["items"]
    assert len(keys) == 1 and key.startswith(keys[0]["prefix"])
    assert key not in json.dumps(keys) and "hash" not in json.dumps(keys)
    assert keys[0]["revoked_at"] is None
    second = admin(server, "POST", f"/tenants/{tenant['id']}/keys").body["key"]
    revoked = admin(server, "DELETE", f"/keys/{keys[0]['id']}")
    assert revoked.status == 200 and revoked.body["revoked_at"] is not None
    assert call(server, "GET", "/v1/models", key).status == 401
    assert call(server, "GET", "/v1/models", second).status == 200
    admin(server, "PATCH", f"/tenants/{tenant['id']}", {"enabled": False})
    assert call(server, "GET", "/v1/models", second).status == 401
    assert admin(server, "DELETE", "/keys/999999").status == 404
    assert admin(server, "POST", "/tenants/999999/keys").status == 404


@pytest.mark.parametrize("raw", [b" ", b"\n", b"{", b"null"])
def test_a_key_body_that_is_not_an_object_is_refused_and_makes_no_key(server, raw):
    """No body at all takes the defaults; a body that is not a JSON object is a 400."""
    tenant, _ = new_tenant(server)
    path = f"{server.base_url}/admin/tenants/{tenant['id']}/keys"
    headers = {"Authorization": f"Bearer {ADMIN_TOKEN}", "Content-Type": "application/json"}
    request = urllib.request.Request(path, raw, headers, method="POST")
    with pytest.raises(urllib.error.HTTPError) as refused:
        urllib.request.urlopen(request, timeout=60).close()
    with refused.value as error:
        assert error.code == 400 and json.loads(error.read())["error"]["type"]
    keys = admin(server, "GET", f"/tenants/{tenant['id']}/keys").body["items"]
    assert len(keys) == 1  # new_tenant's own


def test_usage_counts_tokens_against_quotas(server):
    tenant, key = new_tenant(server, daily_token_quota=10_000, max_concurrency=4, rpm=100)
    reply = complete(server, key, max_tokens=3)
    usage_tokens = reply.body["usage"]["total_tokens"]
    usage = admin(server, "GET", f"/tenants/{tenant['id']}/usage").body
    assert usage["available"] is True and usage["tenant"] == tenant["name"]
    assert usage["tokens_today"] == usage["tokens_this_month"] == usage_tokens
    assert usage["daily_token_quota"] == 10_000
    assert usage["daily_tokens_remaining"] == 10_000 - usage_tokens
    assert usage["concurrency"] == 0 and usage["max_concurrency"] == 4
    assert usage["rpm"] == 100 and usage["requests_remaining"] < 100
    assert admin(server, "GET", "/tenants/999999/usage").status == 404


# ---- the audit log over HTTP -------------------------------------------------------------------
def test_request_list_filters_and_pages(server):
    tenant, key = new_tenant(server, daily_token_quota=50)
    ids = [complete(server, key).request_id for _ in range(3)]
    refused = complete(server, key, max_tokens=60)
    assert refused.status == 429
    audit_detail(server, refused.request_id)  # wait until the last one is written
    base = f"/requests?tenant_id={tenant['id']}"
    everything = admin(server, "GET", base).body["items"]
    assert [item["id"] for item in everything] == [refused.request_id, *reversed(ids)]
    first = admin(server, "GET", base + "&limit=2").body
    assert len(first["items"]) == 2 and first["next_cursor"]
    rest = admin(server, "GET", base + f"&limit=2&cursor={first['next_cursor']}").body
    assert [i["id"] for i in first["items"] + rest["items"]] == [i["id"] for i in everything]
    assert rest["next_cursor"] is None
    rejected = admin(server, "GET", base + "&status=rejected").body["items"]
    assert [(r["id"], r["refusal_reason"]) for r in rejected] == [
        (refused.request_id, "daily_quota")
    ]
    by_name = admin(server, "GET", f"/requests?tenant={tenant['name']}&status=finished").body
    assert sorted(i["id"] for i in by_name["items"]) == sorted(ids)
    assert admin(server, "GET", base + "&priority=7").body["items"] == []
    assert admin(server, "GET", base + "&min_queue_time_s=60").body["items"] == []
    assert admin(server, "GET", base + "&preempted_only=true").body["items"] == []
    since = everything[1]["received_at"]
    recent = admin(server, "GET", base + f"&received_after={since}").body["items"]
    assert [i["id"] for i in recent] == [refused.request_id, ids[-1]]
    assert admin(server, "GET", "/requests?cursor=nonsense").status == 400
    assert admin(server, "GET", "/requests?status=sleeping").status == 400
    assert admin(server, "GET", "/requests?limit=0").status == 400


def test_every_record_field_and_an_explanation_that_adds_up(server):
    _, key = new_tenant(server, default_priority=2, max_priority=1)
    reply = complete(server, key, max_tokens=4, priority=1, ignore_eos=True)
    detail = audit_detail(server, reply.request_id).body
    record = detail["record"]
    assert record["status"] == "finished" and record["finish_reason"] == "length"
    assert record["requested_priority"] == 1 and record["effective_priority"] == 1
    assert record["prompt_tokens"] == reply.body["usage"]["prompt_tokens"]
    assert record["completion_tokens"] == 4
    names = ("received_at", "first_scheduled_at", "first_token_at", "finished_at")
    times = [datetime.fromisoformat(record[name]) for name in names]
    assert times == sorted(times)
    assert record["queue_time_s"] >= 0 and record["preempted_time_s"] == 0
    kinds = [event["kind"] for event in detail["events"]]
    for kind in ("received", "admitted", "queued", "scheduled", "first_token", "finished"):
        assert kind in kinds
    assert kinds[0] == "received" and kinds[-1] == "completed"
    assert detail["explanation"][0].startswith("The request at priority 1 finished (length)")
    named = sum(delay["duration_s"] for delay in detail["delays"])
    assert named == pytest.approx(record_delay_s(record), rel=0.05, abs=2e-3)


def test_the_decode_is_noted_every_32_tokens_for_the_timeline(server):
    _, key = new_tenant(server)
    reply = complete(server, key, max_tokens=70, ignore_eos=True)
    events = audit_detail(server, reply.request_id).body["events"]
    progress = [e for e in events if e["kind"] == "decode_progress"]
    assert [e["data"]["num_output_tokens"] for e in progress] == [32, 64]
    assert [e["time"] for e in progress] == sorted(e["time"] for e in progress)


def test_invalid_requests_are_audited_as_validation_refusals(server):
    _, key = new_tenant(server)
    reply = complete(server, key, max_tokens=0)
    assert reply.status == 400
    unknown_model = call(server, "POST", "/v1/completions", key, {"model": "gpt-5", "prompt": "x"})
    assert unknown_model.status == 404
    for refused in (reply, unknown_model):
        detail = audit_detail(server, refused.request_id).body
        assert detail["record"]["status"] == "rejected"
        assert detail["record"]["refusal_reason"] == "validation"
        assert "invalid request" in detail["explanation"][0]


def test_tenants_read_only_their_own_requests(server):
    _, key_a = new_tenant(server)
    _, key_b = new_tenant(server)
    request_id = complete(server, key_a).request_id
    own = audit_detail(server, request_id, token=key_a)
    assert own.status == 200 and own.body["record"]["id"] == request_id
    assert own.body["explanation"] == audit_detail(server, request_id).body["explanation"]
    assert call(server, "GET", f"/v1/requests/{request_id}", key_b).status == 404
    assert call(server, "GET", "/v1/requests/no-such-request", key_a).status == 404
    assert call(server, "GET", f"/v1/requests/{request_id}").status == 401
    assert admin(server, "GET", "/requests/no-such-request").status == 404


def test_the_body_id_finds_the_record_as_soon_as_the_response_ends(server):
    _, key_a = new_tenant(server)
    _, key_b = new_tenant(server)
    completion = complete(server, key_a)
    chat_body = {"model": MODEL_NAME, "messages": [{"role": "user", "content": "Hi"}]}
    chat = call(server, "POST", "/v1/chat/completions", key_a, {**chat_body, "max_tokens": 2})
    for reply, prefix in ((completion, "cmpl-"), (chat, "chatcmpl-")):
        body_id = reply.body["id"]
        assert body_id == prefix + reply.request_id
        own = call(server, "GET", f"/v1/requests/{body_id}", key_a)  # no retry: read-through
        assert own.status == 200 and own.body["record"]["id"] == reply.request_id
        assert (
            admin(server, "GET", f"/requests/{body_id}").body["record"]["id"]
            == own.body["record"]["id"]
        )
        assert call(server, "GET", f"/v1/requests/{body_id}", key_b).status == 404
    assert call(server, "GET", "/v1/requests/chatcmpl-no-such-request", key_a).status == 404


def test_an_operator_cancels_a_running_request(server):
    _, key = new_tenant(server)
    assert admin(server, "POST", "/requests/nothing-runs-here/cancel").status == 404
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        body = {"max_tokens": 150, "ignore_eos": True, "prompt": "Count to one hundred:"}
        running = pool.submit(complete, server, key, **body)
        request_id = wait_for_running_request(server)
        cancelled = admin(server, "POST", f"/requests/{request_id}/cancel")
        assert cancelled.status == 202 and cancelled.body["num_sequences"] == 1
        reply = running.result(timeout=60)
    assert reply.status == 200 and reply.body["choices"][0]["finish_reason"] == "abort"
    assert reply.body["usage"]["completion_tokens"] < 150
    record = audit_detail(server, request_id).body
    assert record["record"]["status"] == "cancelled"
    assert "cancelled by an operator" in record["explanation"][0]


def wait_for_running_request(server, timeout_s=20.0) -> str:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        engine = admin(server, "GET", "/engine").body
        if engine["running"]:
            return engine["running"][0]["request_id"]
        time.sleep(0.05)
    raise TimeoutError("no request started running")


def test_engine_state_lists_sequences_with_tenant_and_priority(server):
    tenant, key = new_tenant(server, default_priority=4, max_priority=4)
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        running = pool.submit(complete, server, key, max_tokens=40, ignore_eos=True)
        request_id = wait_for_running_request(server)
        engine = admin(server, "GET", "/engine").body
        admin(server, "POST", f"/requests/{request_id}/cancel")
        running.result(timeout=60)
    sequence = next(s for s in engine["running"] if s["request_id"] == request_id)
    assert sequence["tenant"] == tenant["name"] and sequence["priority"] == 4
    assert sequence["sequence_id"] == f"{request_id}-0" and sequence["num_gpu_blocks"] >= 1
    assert 0 < engine["gpu_kv"]["usage"] <= 1 and engine["cpu_kv"]["num_blocks"] > 0
    assert engine["num_inflight_requests"] >= 1 and engine["num_steps"] >= 0
    assert "steps_per_s" in engine and "mean_step_time_s" in engine
    assert {"swap", "recompute"} == set(engine["num_preemptions"])


# ---- OpenAPI -----------------------------------------------------------------------------------
def schema_validator(document: dict, schema: dict) -> Draft202012Validator:
    return Draft202012Validator({**schema, "components": document["components"]})


def request_schema(document: dict, path: str, method: str) -> Draft202012Validator:
    operation = document["paths"][path][method]
    schema = operation["requestBody"]["content"]["application/json"]["schema"]
    return schema_validator(document, schema)


def response_schema(document: dict, path: str, method: str, status: int) -> Draft202012Validator:
    response = document["paths"][path][method]["responses"][str(status)]
    return schema_validator(document, response["content"]["application/json"]["schema"])


def test_openapi_documents_describe_real_traffic(server):
    _, key = new_tenant(server)
    v1 = call(server, "GET", "/v1/openapi.json", key).body
    docs = admin(server, "GET", "/openapi.json").body
    assert v1["openapi"] == docs["openapi"] == "3.1.0"
    assert call(server, "GET", "/admin/openapi.json").status == 401
    for path in (
        "/admin/tenants/{tenant_id}",
        "/admin/tenants/{tenant_id}/usage",
        "/admin/requests",
        "/admin/requests/{request_id}/cancel",
        "/admin/engine",
    ):
        assert path in docs["paths"]  # fmt: skip
    assert {p["name"] for p in docs["paths"]["/admin/requests"]["get"]["parameters"]} >= {
        "tenant_id", "status", "priority", "received_after", "received_before",
        "min_queue_time_s", "preempted_only", "cursor", "limit",
    }  # fmt: skip

    chat = {"model": MODEL_NAME, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}
    request_schema(v1, "/v1/chat/completions", "post").validate(chat)
    reply = call(server, "POST", "/v1/chat/completions", key, chat)
    response_schema(v1, "/v1/chat/completions", "post", 200).validate(reply.body)
    completion = {"model": MODEL_NAME, "prompt": [1, 2, 3], "max_tokens": 1, "n": 2}
    request_schema(v1, "/v1/completions", "post").validate(completion)
    reply = call(server, "POST", "/v1/completions", key, completion)
    response_schema(v1, "/v1/completions", "post", 200).validate(reply.body)
    models = call(server, "GET", "/v1/models", key).body
    response_schema(v1, "/v1/models", "get", 200).validate(models)
    own = audit_detail(server, reply.request_id, token=key).body
    response_schema(v1, "/v1/requests/{request_id}", "get", 200).validate(own)

    # what the schema refuses, the server refuses
    for bad in (
        {**chat, "messages": []},
        {**chat, "temperature": 3},
        {**chat, "max_tokens": "2"},
        {**chat, "n": 9},
    ):
        assert not request_schema(v1, "/v1/chat/completions", "post").is_valid(bad)
        refused = call(server, "POST", "/v1/chat/completions", key, bad)
        assert refused.status == 400
        schema_validator(v1, {"$ref": "#/components/schemas/ErrorBody"}).validate(refused.body)

    tenant_body = {"name": f"oa-{uuid.uuid4().hex[:8]}", "rpm": 10}
    request_schema(docs, "/admin/tenants", "post").validate(tenant_body)
    created = admin(server, "POST", "/tenants", tenant_body)
    response_schema(docs, "/admin/tenants", "post", 201).validate(created.body)
    for bad in ({"name": "bad name!"}, {"name": "ok-name", "rpm": 0}, {"name": "ok", "x": 1}):
        assert not request_schema(docs, "/admin/tenants", "post").is_valid(bad)
        assert admin(server, "POST", "/tenants", bad).status == 400
    patch = {"weight": 3.0, "max_concurrency": None}
    request_schema(docs, "/admin/tenants/{tenant_id}", "patch").validate(patch)
    patched = admin(server, "PATCH", f"/tenants/{created.body['id']}", patch)
    response_schema(docs, "/admin/tenants/{tenant_id}", "patch", 200).validate(patched.body)
    key_reply = admin(server, "POST", f"/tenants/{created.body['id']}/keys")
    response_schema(docs, "/admin/tenants/{tenant_id}/keys", "post", 201).validate(key_reply.body)
    for path, status in (
        ("/admin/tenants", 200),
        ("/admin/tenants/{tenant_id}/keys", 200),
        ("/admin/tenants/{tenant_id}/usage", 200),
        ("/admin/engine", 200),
        ("/admin/requests", 200),
    ):
        real = admin(
            server, "GET", path.removeprefix("/admin").format(tenant_id=created.body["id"])
        )
        response_schema(docs, path, "get", status).validate(real.body)
    detail = audit_detail(server, reply.request_id).body
    response_schema(docs, "/admin/requests/{request_id}", "get", 200).validate(detail)


# ---- metrics and health ------------------------------------------------------------------------
def test_metrics_move_when_they_should(server):
    tenant, key = new_tenant(server, rpm=1)
    before = metric_values(server)
    reply = complete(server, key, max_tokens=3, ignore_eos=True)
    assert complete(server, key).status == 429
    after = metric_values(server)

    def grew(name, labels=(), by=None):
        old = before.get((name, labels), 0.0)
        new = after[(name, labels)]
        return new - old == by if by is not None else new > old

    usage = reply.body["usage"]
    assert grew("conveyor:prompt_tokens_total", by=usage["prompt_tokens"])
    assert grew("conveyor:generation_tokens_total", by=3)
    assert grew("conveyor:request_success_total", (("finished_reason", "length"),), by=1)
    name = tenant["name"]
    assert grew("conveyor:tenant_tokens_total", (("kind", "completion"), ("tenant", name)), by=3)
    assert grew("conveyor:rate_limited_total", (("reason", "rate_limit_requests"), ("tenant", name)), by=1)  # fmt: skip
    for histogram in (
        "time_to_first_token_seconds",
        "e2e_request_latency_seconds",
        "request_queue_time_seconds",
    ):
        assert grew(f"conveyor:{histogram}_count", by=1)  # fmt: skip
    assert grew("conveyor:inter_token_latency_seconds_count", by=2)
    assert grew("conveyor:prefix_cache_queries_total")
    assert after[("conveyor:num_requests_running", ())] == 0
    assert after[("conveyor:kv_cache_usage_perc", ())] == 0
    for gauge in ("num_requests_waiting", "num_requests_swapped", "cpu_kv_cache_usage_perc"):
        assert (f"conveyor:{gauge}", ()) in after


def test_health_probes(server):
    assert call(server, "GET", "/healthz").body == {"status": "ok"}
    ready = call(server, "GET", "/readyz")
    assert ready.status == 200 and all(ready.body["checks"].values())


# ---- forced preemption (tiny KV cache) ---------------------------------------------------------
def test_a_forced_preemption_is_explained_with_its_cause(sqlite_server):
    server = sqlite_server
    low, low_key = new_tenant(server, default_priority=5, max_priority=5)
    high, high_key = new_tenant(server, default_priority=0)
    swaps_before = metric_values(server).get(
        ("conveyor:num_preemptions_total", (("mode", "swap"),)), 0.0
    )
    body = {"model": MODEL_NAME, "prompt": LONG_PROMPT, "max_tokens": 30, "ignore_eos": True,
            "stream": True}  # fmt: skip
    request = urllib.request.Request(
        server.base_url + "/v1/completions",
        json.dumps(body).encode(),
        {"Authorization": f"Bearer {low_key}", "Content-Type": "application/json"},
    )
    with urllib.request.urlopen(request, timeout=60) as stream:
        low_id = stream.headers["x-request-id"]
        assert stream.readline().startswith(b"data: ")  # its first token: it holds 10 blocks
        urgent = complete(server, high_key, prompt="Hello there, how are you? " * 6, max_tokens=5)
        assert urgent.status == 200
        rest = stream.read().decode()
    events = [json.loads(line[6:]) for line in rest.splitlines() if line.startswith("data: {")]
    assert events[-1]["choices"][0]["finish_reason"] == "length"

    detail = audit_detail(server, low_id).body
    record = detail["record"]
    assert record["num_preemptions_swap"] >= 1 and record["preempted_time_s"] > 0
    text = "\n".join(detail["explanation"])
    assert f"by request {urgent.request_id} (priority 0, tenant {high['name']})" in text
    assert "KV blocks swapped to CPU and back" in text and "resumed after" in text
    named = sum(delay["duration_s"] for delay in detail["delays"])
    assert named == pytest.approx(record_delay_s(record), rel=0.05, abs=2e-3)
    assert any(delay["cause"] == "preempted" for delay in detail["delays"])

    # the tenant sees the same story without the other tenant's name or request id
    own = audit_detail(server, low_id, token=low_key).body
    own_text = json.dumps(own)
    assert urgent.request_id not in own_text and high["name"] not in own_text
    assert "by a request of another tenant (priority 0)" in "\n".join(own["explanation"])

    preempted = admin(server, "GET", f"/requests?tenant_id={low['id']}&preempted_only=true")
    assert [item["id"] for item in preempted.body["items"]] == [low_id]
    swaps_after = metric_values(server)[("conveyor:num_preemptions_total", (("mode", "swap"),))]
    assert swaps_after >= swaps_before + 1


# ---- outages (PostgreSQL and Redis through proxies) --------------------------------------------
def direct_audit_counts(database_url: str, request_ids: list[str]) -> tuple[int, int, int]:
    """(records, events, distinct (request, seq) events) for these ids, bypassing the proxy."""
    with psycopg.connect(database_url) as connection:
        rows = connection.execute(
            "SELECT count(*) FROM audit_records WHERE id = ANY(%s)", (request_ids,)
        ).fetchone()
        events = connection.execute(
            "SELECT count(*), count(DISTINCT (request_id, seq)) FROM audit_events "
            "WHERE request_id = ANY(%s)",
            (request_ids,),
        ).fetchone()
    return rows[0], events[0], events[1]


def test_a_database_outage_loses_and_duplicates_no_audit_record(postgres_server, postgres_proxies):
    server, (pg_proxy, _) = postgres_server, postgres_proxies
    _, key = new_tenant(server)
    spool = server.workdir / "audit.spool"
    ids = [complete(server, key).request_id]
    assert audit_detail(server, ids[0]).status == 200  # stored before the outage
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        body = {"max_tokens": 96, "ignore_eos": True}
        running = [pool.submit(complete, server, key, f"Story {i}:", **body) for i in range(4)]
        wait_until(lambda: admin(server, "GET", "/engine").body["num_inflight_requests"] == 4, 20)
        pg_proxy.cut()  # all four are authenticated and admitted: they run on
        replies = [future.result(timeout=60) for future in running]
    try:
        assert [reply.status for reply in replies] == [200] * 4
        ids += [reply.request_id for reply in replies]
        ready = call(server, "GET", "/readyz")  # known keys keep working (--auth-stale-for)
        assert ready.status == 200 and ready.body["checks"]["database"] is False
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and len(read_lines(spool)) < 4:
            time.sleep(0.1)
        assert len(read_lines(spool)) == 4  # the four records wait in the spool
    finally:
        pg_proxy.restore()
    deadline = time.monotonic() + 20
    while (
        time.monotonic() < deadline and direct_audit_counts(server.direct_database_url, ids)[0] < 5
    ):
        time.sleep(0.2)
    records, events, distinct_events = direct_audit_counts(server.direct_database_url, ids)
    assert records == 5 and events == distinct_events > 5 * 5
    for request_id in ids:
        detail = audit_detail(server, request_id).body
        assert detail["record"]["status"] == "finished"
        assert len(detail["events"]) == len({event["seq"] for event in detail["events"]})
    wait_until(lambda: read_lines(spool) == [], 10)  # replayed, then emptied
    wait_until(lambda: call(server, "GET", "/readyz").status == 200, 10)


def test_a_redis_outage_keeps_a_fail_open_replica_ready(postgres_server, postgres_proxies):
    server, (_, redis_proxy) = postgres_server, postgres_proxies
    _, key = new_tenant(server, rpm=1000)
    redis_proxy.cut()
    try:
        ready = call(server, "GET", "/readyz")
        assert ready.status == 200 and ready.body["checks"]["redis"] is False
        reply = complete(server, key)  # served without rate limits
        assert reply.status == 200 and "x-ratelimit-limit-requests" not in reply.headers
        detail = audit_detail(server, reply.request_id).body
        admitted = next(e for e in detail["events"] if e["kind"] == "admitted")
        assert admitted["data"]["rate_limits_unchecked"] is True
    finally:
        redis_proxy.restore()
    wait_until(lambda: call(server, "GET", "/readyz").body["checks"]["redis"] is True, 10)


def read_lines(path: Path) -> list[str]:
    return path.read_text().splitlines() if path.exists() else []


def wait_until(predicate, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.1)
