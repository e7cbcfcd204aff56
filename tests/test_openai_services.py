"""End to end against the production services: a real `conveyor serve` process on the real
PostgreSQL (a fresh schema) and the real Redis, driven by the official `openai` client.

Redis or PostgreSQL being down fails these tests; they never skip."""

from __future__ import annotations

import asyncio
import uuid

import openai
import pytest
import redis
from test_db_support import temporary_database
from test_server_support import ENGINE_ARGS as SERVER_ARGS
from test_server_support import (
    MODEL_NAME,
    ServerProcess,
    create_tenant_with_key,
    get_json,
    real_service_urls,
    server_env,
    serving,
)

pytestmark = [pytest.mark.slow, pytest.mark.real_model]

REDIS_URL, POSTGRES_URL = real_service_urls()


def check_redis_is_up() -> None:
    with redis.Redis.from_url(REDIS_URL, socket_connect_timeout=2) as client:
        client.ping()  # raises (and so fails the tests) when Redis is down


@pytest.fixture(scope="session")
def services_server(tmp_path_factory) -> ServerProcess:
    check_redis_is_up()
    workdir = tmp_path_factory.mktemp("services-server")
    with temporary_database("postgresql", workdir, POSTGRES_URL) as database_url:
        env = server_env(database_url, REDIS_URL, workdir)
        server = ServerProcess(workdir, env, SERVER_ARGS, database_url=database_url)
        with serving(server):
            yield server


@pytest.fixture(scope="session")
def services_key(services_server) -> str:
    key = services_server.demo_key()  # a fresh schema has no tenants: the demo tenant appears
    assert key, services_server.log_text()
    return key


def client_for(server: ServerProcess, key: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.base_url + "/v1", api_key=key, max_retries=0)


def test_readyz_sees_postgres_and_redis(services_server):
    status, body = get_json(services_server.base_url + "/readyz")
    assert status == 200
    assert body["checks"] == {"model": True, "database": True, "redis": True, "accepting": True}


def test_sync_and_streaming_chat(services_server, services_key):
    messages = [{"role": "user", "content": "Hi"}]
    with client_for(services_server, services_key) as client:
        completion = client.chat.completions.create(
            model=MODEL_NAME, messages=messages, max_tokens=3, temperature=0
        )
        stream = client.chat.completions.create(
            model=MODEL_NAME,
            messages=messages,
            max_tokens=3,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
        chunks = list(stream)
    streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert streamed == completion.choices[0].message.content
    assert chunks[-1].usage.completion_tokens == completion.usage.completion_tokens


async def test_async_completions(services_server, services_key):
    async with openai.AsyncOpenAI(
        base_url=services_server.base_url + "/v1", api_key=services_key, max_retries=0
    ) as client:
        completions = await asyncio.gather(
            *[
                client.completions.create(model=MODEL_NAME, prompt=f"{i} + {i} =", max_tokens=2)
                for i in range(3)
            ]
        )
    assert all(c.usage.completion_tokens <= 2 for c in completions)


def test_rate_limits_live_in_the_real_redis(services_server):
    name = f"rl-{uuid.uuid4().hex[:10]}"
    key = create_tenant_with_key(services_server.database_url, name, rpm=1)
    with client_for(services_server, key) as client:
        client.completions.create(model=MODEL_NAME, prompt="hi", max_tokens=1)
        with pytest.raises(openai.RateLimitError) as caught:
            client.completions.create(model=MODEL_NAME, prompt="hi", max_tokens=1)
    assert caught.value.code == "rate_limit_exceeded"
    assert int(caught.value.response.headers["Retry-After"]) >= 1
    with redis.Redis.from_url(REDIS_URL) as client:
        assert client.keys(f"conveyor:rl:{{{name}}}:*")


def test_a_bad_key_is_refused_against_postgres(services_server):
    with (
        client_for(services_server, "cvy_" + "x" * 40) as client,
        pytest.raises(openai.AuthenticationError),
    ):
        client.models.list()
