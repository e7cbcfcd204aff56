"""Tenants, API keys and authentication against SQLite and the real PostgreSQL."""

from __future__ import annotations

import asyncio

import pytest
from pydantic import ValidationError
from sqlalchemy import event, select, text
from test_db_support import BACKENDS, temporary_database

from gateway.db import (
    async_url,
    check_database,
    make_async_engine,
    make_sessionmaker,
    parse_database_url,
    sync_url,
    upgrade,
)
from gateway.models import ApiKey
from gateway.tenancy.keys import (
    ApiKeyNotFound,
    Authenticator,
    KeyHasher,
    create_key,
    list_keys,
    revoke_key,
)
from gateway.tenancy.tenants import (
    TenantCreate,
    TenantNameTaken,
    TenantNotFound,
    TenantUpdate,
    create_tenant,
    delete_tenant,
    get_tenant,
    get_tenant_by_name,
    list_tenants,
    update_tenant,
)

SECRET = "test-secret"


@pytest.fixture(params=BACKENDS)
def database_url(request, tmp_path, postgres_url):
    with temporary_database(request.param, tmp_path, postgres_url) as url:
        upgrade(url)
        yield url


@pytest.fixture
async def engine(database_url):
    engine = make_async_engine(database_url)
    yield engine
    await engine.dispose()


@pytest.fixture
def sessionmaker(engine):
    return make_sessionmaker(engine)


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


async def new_tenant(sessionmaker, name: str = "acme", **fields):
    async with sessionmaker.begin() as session:
        return await create_tenant(session, TenantCreate(name=name, **fields))


async def new_key(sessionmaker, tenant_id: int):
    async with sessionmaker.begin() as session:
        return await create_key(session, tenant_id, KeyHasher(SECRET))


# --- URLs (no database) -----------------------------------------------------------------------


@pytest.mark.parametrize(
    ("plain", "sync_driver", "async_driver"),
    [
        ("postgresql://user@host/db", "postgresql+psycopg", "postgresql+psycopg"),
        ("postgres://user:pw@host:5433/db", "postgresql+psycopg", "postgresql+psycopg"),
        ("postgresql+asyncpg://user@host/db", "postgresql+psycopg", "postgresql+psycopg"),
        ("sqlite:///conveyor.db", "sqlite", "sqlite+aiosqlite"),
        ("sqlite:///:memory:", "sqlite", "sqlite+aiosqlite"),
    ],
)
def test_plain_urls_get_the_project_drivers(plain, sync_driver, async_driver):
    assert sync_url(plain).drivername == sync_driver
    assert async_url(plain).drivername == async_driver
    assert sync_url(plain).database == parse_database_url(plain).database


def test_unsupported_url_is_refused_without_showing_the_password():
    with pytest.raises(ValueError, match="unsupported") as raised:
        parse_database_url("mysql://user:hunter2@host/db")
    assert "hunter2" not in str(raised.value)


async def test_memory_sqlite_engine_works():
    engine = make_async_engine("sqlite:///:memory:")
    assert await check_database(engine)
    await engine.dispose()


# --- tenant CRUD ------------------------------------------------------------------------------


async def test_tenant_crud_round_trip(sessionmaker, database_url):
    created = await new_tenant(sessionmaker, rpm=600, tpm=100_000, weight=2.5, max_priority=-1)
    async with sessionmaker.begin() as session:
        assert await get_tenant(session, created.id) == created
        assert await get_tenant_by_name(session, "acme") == created
        changes = TenantUpdate(rpm=None, enabled=False, daily_token_quota=5_000_000_000)
        updated = await update_tenant(session, created.id, changes)
    assert (updated.rpm, updated.enabled, updated.tpm) == (None, False, 100_000)
    assert updated.daily_token_quota == 5_000_000_000
    async with sessionmaker.begin() as session:
        assert [t.name for t in await list_tenants(session)] == ["acme"]
        assert (await get_tenant(session, created.id)).enabled is False
        await delete_tenant(session, created.id)
    async with sessionmaker() as session:
        assert await list_tenants(session) == []
        with pytest.raises(TenantNotFound):
            await get_tenant(session, created.id)


async def test_tenant_out_has_exactly_the_shared_field_names(sessionmaker):
    created = await new_tenant(sessionmaker)
    assert set(created.model_dump()) == {
        "id", "name", "default_priority", "max_priority", "weight", "rpm", "burst", "tpm",
        "max_concurrency", "daily_token_quota", "monthly_token_quota", "max_grammar_bytes",
        "enabled", "model_limits",
    }  # fmt: skip
    assert (created.default_priority, created.max_priority, created.weight) == (0, 0, 1.0)
    assert created.burst == 0  # no extra unless set


async def test_duplicate_names_are_refused(sessionmaker):
    await new_tenant(sessionmaker, "acme")
    other = await new_tenant(sessionmaker, "globex")
    with pytest.raises(TenantNameTaken):
        await new_tenant(sessionmaker, "acme")
    with pytest.raises(TenantNameTaken):
        async with sessionmaker.begin() as session:
            await update_tenant(session, other.id, TenantUpdate(name="acme"))


@pytest.mark.parametrize(
    "fields",
    [
        {"weight": 0},
        {"weight": -1.0},
        {"weight": float("inf")},
        {"rpm": 0},
        {"tpm": -5},
        {"max_concurrency": 0},
        {"daily_token_quota": 0},
        {"monthly_token_quota": 0},
        {"default_priority": 1, "max_priority": 2},
        {"name": ""},
        {"name": "{acme}"},
        {"colour": "blue"},
    ],
)
def test_invalid_tenants_are_refused(fields):
    with pytest.raises(ValidationError):
        TenantCreate.model_validate({"name": "acme", **fields})


async def test_update_is_validated_against_the_stored_tenant(sessionmaker):
    tenant = await new_tenant(sessionmaker, default_priority=2, max_priority=1)
    for bad in ({"max_priority": 3}, {"default_priority": 0}, {"weight": None}, {"rpm": 0}):
        with pytest.raises(ValidationError):
            async with sessionmaker.begin() as session:
                await update_tenant(session, tenant.id, TenantUpdate.model_validate(bad))
    async with sessionmaker() as session:
        assert await get_tenant(session, tenant.id) == tenant


async def test_missing_tenant_is_reported(sessionmaker):
    async with sessionmaker.begin() as session:
        for call in (get_tenant, delete_tenant, list_keys):
            with pytest.raises(TenantNotFound):
                await call(session, 999)
        with pytest.raises(TenantNotFound):
            await update_tenant(session, 999, TenantUpdate(rpm=1))
        with pytest.raises(ApiKeyNotFound):
            await revoke_key(session, 999)


# --- API keys ---------------------------------------------------------------------------------


async def test_keys_are_stored_only_as_keyed_hashes(sessionmaker, engine):
    tenant = await new_tenant(sessionmaker)
    key, plaintext = await new_key(sessionmaker, tenant.id)
    assert plaintext.startswith("cvy_") and len(plaintext) == 44
    assert key.prefix == plaintext[:8]
    assert KeyHasher(SECRET).verify(plaintext, key.key_hash)
    assert not KeyHasher("another-secret").verify(plaintext, key.key_hash)
    async with engine.connect() as connection:
        stored = (await connection.execute(text("SELECT * FROM api_keys"))).one()
    assert plaintext not in {str(value) for value in stored}
    assert plaintext[len("cvy_") :] not in " ".join(str(value) for value in stored)


async def test_keys_are_listed_revoked_and_deleted_with_their_tenant(sessionmaker):
    tenant = await new_tenant(sessionmaker)
    first, _ = await new_key(sessionmaker, tenant.id)
    second, _ = await new_key(sessionmaker, tenant.id)
    async with sessionmaker.begin() as session:
        revoked = await revoke_key(session, first.id)
        assert revoked.revoked_at is not None
        assert (await revoke_key(session, first.id)).revoked_at == revoked.revoked_at
        keys = await list_keys(session, tenant.id)
    assert [k.id for k in keys] == [first.id, second.id]
    assert [k.revoked_at is None for k in keys] == [False, True]
    async with sessionmaker.begin() as session:
        await delete_tenant(session, tenant.id)
    async with sessionmaker() as session:
        assert (await session.scalars(select(ApiKey))).all() == []


# --- authentication ---------------------------------------------------------------------------


async def test_authenticator_maps_keys_to_tenants(sessionmaker):
    tenant = await new_tenant(sessionmaker)
    key, plaintext = await new_key(sessionmaker, tenant.id)
    authenticator = Authenticator(sessionmaker, KeyHasher(SECRET))
    found_tenant, found_key = await authenticator.authenticate(plaintext)
    assert (found_tenant, found_key.id, found_key.prefix) == (tenant, key.id, key.prefix)
    wrong = plaintext[:-1] + ("A" if plaintext[-1] != "A" else "B")
    odd = "cvy_" + "\udc80" * 40  # undecodable header bytes must not crash hashing
    for bad in (wrong, "", "Bearer " + plaintext, "cvy_short", plaintext + "x", odd):
        assert await authenticator.authenticate(bad) is None
    await authenticator.close()


@pytest.mark.parametrize("change", ["revoke", "disable"])
async def test_revoked_or_disabled_stops_working_on_every_replica_after_the_cache_ttl(
    sessionmaker, change
):
    tenant = await new_tenant(sessionmaker)
    key, plaintext = await new_key(sessionmaker, tenant.id)
    clock = FakeClock()
    replicas = [Authenticator(sessionmaker, KeyHasher(SECRET), clock=clock) for _ in range(2)]
    for replica in replicas:
        assert await replica.authenticate(plaintext) is not None
    async with sessionmaker.begin() as session:
        if change == "revoke":
            await revoke_key(session, key.id)
        else:
            await update_tenant(session, tenant.id, TenantUpdate(enabled=False))
    clock.now += 1.0  # still inside the 2 s cache lifetime: cached answer
    assert all([await replica.authenticate(plaintext) is not None for replica in replicas])
    clock.now += 1.01
    assert [await replica.authenticate(plaintext) for replica in replicas] == [None, None]
    for replica in replicas:
        await replica.close()


async def test_concurrent_misses_share_one_query_and_hits_query_nothing(sessionmaker, engine):
    tenant = await new_tenant(sessionmaker)
    _, plaintext = await new_key(sessionmaker, tenant.id)
    key_queries = []

    def count_key_queries(conn, cursor, statement, *args):
        if "FROM api_keys JOIN tenants" in statement:
            key_queries.append(statement)

    event.listen(engine.sync_engine, "before_cursor_execute", count_key_queries)
    authenticator = Authenticator(sessionmaker, KeyHasher(SECRET))
    results = await asyncio.gather(*[authenticator.authenticate(plaintext) for _ in range(20)])
    results.append(await authenticator.authenticate(plaintext))
    assert all(result is not None for result in results)
    assert len(key_queries) == 1
    await authenticator.close()


async def test_last_used_at_is_written_at_most_once_a_minute(sessionmaker):
    tenant = await new_tenant(sessionmaker)
    key, plaintext = await new_key(sessionmaker, tenant.id)
    clock = FakeClock()
    authenticator = Authenticator(sessionmaker, KeyHasher(SECRET), clock=clock, ttl_s=0.0)

    async def last_used():
        await authenticator.close()
        async with sessionmaker() as session:
            return (await session.get(ApiKey, key.id)).last_used_at

    await authenticator.authenticate(plaintext)
    first = await last_used()
    assert first is not None and first.tzinfo is not None
    for _ in range(5):
        clock.now += 10
        await authenticator.authenticate(plaintext)
    assert await last_used() == first
    clock.now += 15  # 65 s after the first write
    await authenticator.authenticate(plaintext)
    assert await last_used() > first
