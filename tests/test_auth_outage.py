"""A database outage is not a serving outage (`--auth-stale-for`).

Keys valid at their last check keep working while PostgreSQL is unreachable, for at most
`stale_for_s`; keys without a recent answer get 503; a revocation applies as soon as the
database answers again; no audit record is lost.

The unit tests drive `Authenticator` with a fake clock against the real PostgreSQL behind a
proxy that cuts it. The end-to-end test serves from a private PostgreSQL cluster of its own
(initdb + pg_ctl in a temporary directory; never the shared one others' tests use), stops it
for 8 s under steady traffic and starts it again.
"""

from __future__ import annotations

import asyncio
import glob
import os
import pwd
import shutil
import subprocess
import tempfile
import time
from pathlib import Path

import aiohttp
import psycopg
import pytest
from sqlalchemy.engine import make_url
from sqlalchemy.exc import SQLAlchemyError
from test_db_support import ToggleProxy, temporary_database, with_port
from test_server_support import (
    KEY_HASH_SECRET,
    ServerProcess,
    audit_records_of,
    create_tenant_with_key,
    free_port,
    server_env,
    serving,
    tiny_engine_args,
)

from gateway.db import make_async_engine, make_sessionmaker, upgrade
from gateway.tenancy.keys import (
    Authenticator,
    KeyHasher,
    create_key,
    new_plaintext_key,
    revoke_key,
)
from gateway.tenancy.tenants import TenantCreate, create_tenant

DATABASE_DOWN = (SQLAlchemyError, OSError)  # what the caller turns into a 503


# ---- unit: the Authenticator with a fake clock ---------------------------------------------


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
async def cut_database(tmp_path, postgres_url):
    """(sessionmaker through a proxy that can cut PostgreSQL, the proxy, a direct sessionmaker)."""
    with temporary_database("postgresql", tmp_path, postgres_url) as url:
        upgrade(url)
        host = make_url(url)
        proxy = ToggleProxy(host.host or "127.0.0.1", host.port or 5432)
        await proxy.start()
        through_proxy = make_async_engine(with_port(url, proxy.port))
        direct = make_async_engine(url)
        yield make_sessionmaker(through_proxy), proxy, make_sessionmaker(direct)
        await through_proxy.dispose()
        await direct.dispose()
        await proxy.close()


async def tenant_with_key(sessionmaker, name: str) -> tuple[int, str]:
    async with sessionmaker.begin() as session:
        tenant = await create_tenant(session, TenantCreate(name=name, rpm=60))
        key, plaintext = await create_key(session, tenant.id, KeyHasher(KEY_HASH_SECRET))
    return key.id, plaintext


async def test_known_keys_work_through_an_outage_for_stale_for_s(cut_database):
    sessionmaker, proxy, _ = cut_database
    _, plaintext = await tenant_with_key(sessionmaker, "acme")
    clock = FakeClock()
    authenticator = Authenticator(
        sessionmaker, KeyHasher(KEY_HASH_SECRET), stale_for_s=300, clock=clock
    )
    fresh = await authenticator.authenticate(plaintext)
    assert fresh is not None and fresh.tenant.rpm == 60
    await proxy.cut()
    clock.now += 3  # the 2 s cached answer has expired: the database is asked, and fails
    stale = await authenticator.authenticate(plaintext)
    assert stale == fresh  # the tenant and its limits as last read
    clock.now += 290
    assert await authenticator.authenticate(plaintext) == fresh
    with pytest.raises(DATABASE_DOWN):  # never seen: the caller answers 503
        await authenticator.authenticate(new_plaintext_key())
    clock.now += 10  # 303 s after the last answer from the database
    with pytest.raises(DATABASE_DOWN):
        await authenticator.authenticate(plaintext)
    await proxy.restore()


async def test_stale_for_0_refuses_as_soon_as_the_cached_answer_expires(cut_database):
    sessionmaker, proxy, _ = cut_database
    _, plaintext = await tenant_with_key(sessionmaker, "acme")
    clock = FakeClock()
    authenticator = Authenticator(sessionmaker, KeyHasher(KEY_HASH_SECRET), clock=clock)
    assert await authenticator.authenticate(plaintext) is not None
    await proxy.cut()
    clock.now += 1  # still cached
    assert await authenticator.authenticate(plaintext) is not None
    clock.now += 1.5
    with pytest.raises(DATABASE_DOWN):
        await authenticator.authenticate(plaintext)
    await proxy.restore()


async def test_a_revocation_applies_as_soon_as_the_database_answers(cut_database):
    sessionmaker, proxy, direct = cut_database
    key_id, plaintext = await tenant_with_key(sessionmaker, "acme")
    clock = FakeClock()
    authenticator = Authenticator(
        sessionmaker, KeyHasher(KEY_HASH_SECRET), stale_for_s=300, clock=clock
    )
    assert await authenticator.authenticate(plaintext) is not None
    await proxy.cut()
    async with direct.begin() as session:  # revoked while this replica cannot see it
        await revoke_key(session, key_id)
    clock.now += 3
    assert await authenticator.authenticate(plaintext) is not None  # the trade: last answer
    clock.now += 1  # asked again at most every ttl_s while the database is away
    assert await authenticator.authenticate(plaintext) is not None
    await proxy.restore()
    clock.now += 2.01
    assert await authenticator.authenticate(plaintext) is None


# ---- end to end: a private PostgreSQL stopped under load -------------------------------------


def postgres_binary(name: str) -> str:
    found = sorted(glob.glob(f"/usr/lib/postgresql/*/bin/{name}")) or [shutil.which(name)]
    assert found[-1], f"no {name}: PostgreSQL's server binaries are needed"
    return found[-1]


def cluster_owner() -> str:
    """Who runs the private cluster when the tests run as root."""
    try:
        pwd.getpwnam("postgres")
    except KeyError:
        return "nobody"
    return "postgres"


CLUSTER_OWNER = cluster_owner()


class PrivatePostgres:
    """A throwaway PostgreSQL cluster on a free port, owned by this test alone."""

    def __init__(self) -> None:
        self.root = Path(tempfile.mkdtemp(prefix="conveyor-pg-"))
        self.data = self.root / "data"
        self.port = free_port()
        if os.geteuid() == 0:  # initdb refuses to run as root
            shutil.chown(self.root, CLUSTER_OWNER)

    @property
    def url(self) -> str:
        return f"postgresql://postgres@127.0.0.1:{self.port}/postgres"

    def run(self, *command: str) -> None:
        if os.geteuid() == 0:
            command = ("runuser", "-u", CLUSTER_OWNER, "--", *command)
        subprocess.run(command, check=True, capture_output=True, timeout=120, cwd=self.root)

    def init(self) -> PrivatePostgres:
        self.run(postgres_binary("initdb"), "-D", str(self.data), "-A", "trust", "-U",
                 "postgres", "-E", "UTF8", "--no-sync")  # fmt: skip
        return self

    def start(self) -> None:
        options = f"-p {self.port} -k {self.root} -c listen_addresses=127.0.0.1 -c fsync=off"
        self.run(postgres_binary("pg_ctl"), "-D", str(self.data), "-o", options, "-w",
                 "-l", str(self.root / "postgres.log"), "start")  # fmt: skip

    def stop(self) -> None:
        self.run(postgres_binary("pg_ctl"), "-D", str(self.data), "-m", "fast", "-w", "stop")

    def remove(self) -> None:
        if (self.data / "postmaster.pid").exists():  # still running
            self.stop()
        shutil.rmtree(self.root, ignore_errors=True)


@pytest.fixture(scope="module")
def private_postgres():
    cluster = PrivatePostgres().init()
    cluster.start()
    try:
        yield cluster
    finally:
        cluster.remove()


@pytest.fixture(scope="module")
def outage_server(tmp_path_factory, tiny_model_dir, private_postgres):
    workdir = tmp_path_factory.mktemp("auth-outage")
    env = server_env(private_postgres.url, None, workdir)
    env |= {"CONVEYOR_CREATE_DEMO_TENANT": "false"}  # default --auth-stale-for: 300 s
    server = ServerProcess(workdir, env, tiny_engine_args(tiny_model_dir), private_postgres.url)
    with serving(server):
        yield server


OUTAGE_S = 8.0


async def complete(session: aiohttp.ClientSession, server, key: str, model: str):
    body = {"model": model, "prompt": [100, 200, 300], "max_tokens": 2}
    headers = {"Authorization": f"Bearer {key}"}
    async with session.post(server.base_url + "/v1/completions", json=body, headers=headers) as r:
        await r.read()
        return r.status, r.headers.get("x-request-id")


async def steady_traffic(server, key: str, model: str, until: float) -> list[tuple]:
    """(time, status, request id) of one request every 0.1 s until `until`."""
    outcomes = []
    async with aiohttp.ClientSession() as session:
        while time.monotonic() < until:
            status, request_id = await complete(session, server, key, model)
            outcomes.append((time.monotonic(), status, request_id))
            await asyncio.sleep(0.1)
    return outcomes


def revoke_directly(database_url: str, key: str) -> None:
    with psycopg.connect(database_url, autocommit=True) as connection:
        connection.execute(
            "UPDATE api_keys SET revoked_at = now() WHERE key_hash = %s",
            (KeyHasher(KEY_HASH_SECRET).hash(key),),
        )


@pytest.mark.slow
async def test_a_database_outage_is_not_a_serving_outage(
    outage_server, private_postgres, tiny_model_dir
):
    server, model, url = outage_server, tiny_model_dir.name, private_postgres.url
    steady = await asyncio.to_thread(create_tenant_with_key, url, "steady")
    doomed = await asyncio.to_thread(create_tenant_with_key, url, "doomed")
    started = time.monotonic()
    traffic = [
        asyncio.ensure_future(steady_traffic(server, key, model, started + OUTAGE_S + 10))
        for key in (steady, doomed)
    ]
    await asyncio.sleep(2.0)
    await asyncio.to_thread(revoke_directly, url, doomed)  # seen only once the database is back
    await asyncio.to_thread(private_postgres.stop)
    stopped_at = time.monotonic()
    await asyncio.sleep(3.0)  # every cached answer (2 s) has expired
    async with aiohttp.ClientSession() as session:
        unknown_status, _ = await complete(session, server, new_plaintext_key(), model)
        ready = await session.get(server.base_url + "/readyz")
        ready_body = await ready.json()
    await asyncio.sleep(OUTAGE_S - 3.0)
    await asyncio.to_thread(private_postgres.start)
    restarted_at = time.monotonic()
    steady_outcomes, doomed_outcomes = await asyncio.gather(*traffic)

    assert unknown_status == 503  # unknown keys: refused as before
    assert ready.status == 200 and ready_body["checks"]["database"] is False
    statuses = [status for _, status, _ in steady_outcomes]
    assert set(statuses) == {200}, statuses  # not one 503 for a known key
    during = [s for t, s, _ in steady_outcomes if stopped_at + 2.5 < t < restarted_at]
    assert len(during) > 10  # traffic really ran while the database was down
    assert 503 not in {status for _, status, _ in doomed_outcomes}
    after = [s for t, s, _ in doomed_outcomes if t > restarted_at + 5.0]
    assert after and set(after) == {401}  # the revocation applied once the database answered

    served = {request_id for _, status, request_id in steady_outcomes if status == 200}
    deadline = time.monotonic() + 30
    while True:  # audit records spooled during the outage are replayed
        records = await asyncio.to_thread(audit_records_of, url, "steady")
        if {r["id"] for r in records} >= served or time.monotonic() > deadline:
            break
        await asyncio.sleep(0.5)
    assert {r["id"] for r in records} == served  # none lost, none extra
