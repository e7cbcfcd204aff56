"""Several gateway replicas in one test: in-process aiohttp apps (the real app factory, each with
its own authentication cache, rate limiter and audit writer) sharing the real Redis, one fresh
PostgreSQL schema and one tiny engine (what replicas share or not is the gateway's state; the
engine behind them does not matter to keys and limits).

Redis or PostgreSQL being down fails these tests; they never skip.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from pathlib import Path
from typing import Any

import pytest
import redis
from aiohttp.test_utils import TestClient, TestServer
from test_db_support import temporary_database
from test_server_support import ADMIN_TOKEN, KEY_HASH_SECRET, real_service_urls, tiny_engine_args

from gateway import app as gateway_app
from gateway.appkeys import ENGINE_CLIENT
from gateway.cli import build_parser
from gateway.db import upgrade
from gateway.serve import settings_from_args

REDIS_URL, POSTGRES_URL = real_service_urls()
ADMIN = {"Authorization": f"Bearer {ADMIN_TOKEN}"}


def replica_settings(database_url: str, model_dir: Path, workdir: Path):
    argv = ["serve", *tiny_engine_args(model_dir), "--database-url", database_url,
            "--redis-url", REDIS_URL, "--key-hash-secret", KEY_HASH_SECRET,
            "--admin-tokens", ADMIN_TOKEN, "--no-demo-tenant",
            "--audit-spool-path", str(workdir / "audit.spool")]  # fmt: skip
    settings = settings_from_args(build_parser().parse_args(argv))
    return settings.model_copy(update={"auto_migrate": False})


@pytest.fixture(scope="module")
def shared_engine(tiny_model_dir, tmp_path_factory):
    """One engine client for every replica of the module."""
    from runtime.engine import Engine
    from runtime.engine_client import EngineClient

    settings = replica_settings("sqlite://", tiny_model_dir, tmp_path_factory.mktemp("engine"))
    client = EngineClient(Engine(settings.engine_config()))
    client.start()
    yield client
    client.stop()


@pytest.fixture(scope="module")
def replica_database(tmp_path_factory):
    with redis.Redis.from_url(REDIS_URL, socket_connect_timeout=2) as client:
        client.ping()  # raises (and so fails the tests) when Redis is down
    root = tmp_path_factory.mktemp("replica-db")
    with temporary_database("postgresql", root, POSTGRES_URL) as url:
        upgrade(url)
        yield url


def replica_app(settings, engine_client):
    app = gateway_app.create_app(settings)

    async def shared_engine_ctx(app):
        app[ENGINE_CLIENT] = engine_client
        yield

    index = list(app.cleanup_ctx).index(gateway_app.engine_ctx)
    app.cleanup_ctx[index] = shared_engine_ctx
    return app


@contextlib.asynccontextmanager
async def replicas(num: int, database_url: str, engine_client, model_dir: Path, workdir: Path,
                   **overrides: Any):  # fmt: skip
    """`num` started replicas, as aiohttp test clients."""
    clients = []
    try:
        for i in range(num):
            folder = workdir / f"replica{i}"
            folder.mkdir(exist_ok=True)
            settings = replica_settings(database_url, model_dir, folder)
            settings = settings.model_copy(update=overrides)
            client = TestClient(TestServer(replica_app(settings, engine_client)))
            await client.start_server()
            clients.append(client)
        yield clients
    finally:
        for client in clients:
            await client.close()


async def admin_call(client: TestClient, method: str, path: str, body=None) -> tuple[int, Any]:
    response = await client.request(method, "/admin" + path, json=body, headers=ADMIN)
    return response.status, await response.json() if response.status != 204 else None


async def new_tenant(client: TestClient, name: str, **fields) -> dict:
    status, tenant = await admin_call(client, "POST", "/tenants", {"name": name, **fields})
    assert status == 201, tenant
    return tenant


async def new_key(client: TestClient, tenant_id: int, **fields) -> dict:
    status, key = await admin_call(client, "POST", f"/tenants/{tenant_id}/keys", fields)
    assert status == 201, key
    return key


async def complete(client: TestClient, key: str, model: str, max_tokens: int = 1,
                   path: str = "/v1/completions"):  # fmt: skip
    """(status, body, headers) of one small completion."""
    body = {"model": model, "prompt": [100, 200, 300, 400], "max_tokens": max_tokens,
            "ignore_eos": True}  # fmt: skip
    if path.endswith("chat/completions"):
        body = {"model": model, "messages": [{"role": "user", "content": "hi"}],
                "max_tokens": max_tokens}  # fmt: skip
    response = await client.post(path, json=body, headers={"Authorization": f"Bearer {key}"})
    return response.status, await response.json(), response.headers


async def wait_for(predicate, timeout_s: float = 10.0, interval_s: float = 0.1):
    deadline = time.monotonic() + timeout_s
    while True:
        value = await predicate()
        if value or time.monotonic() > deadline:
            return value
        await asyncio.sleep(interval_s)
