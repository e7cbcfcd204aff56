"""The audit writer against SQLite and the real PostgreSQL: batching, drain on close, and
database outages (PostgreSQL cut through a TCP proxy; SQLite made to refuse connections) that end
with every record stored exactly once."""

from __future__ import annotations

import asyncio
import random
import sqlite3
import time
from datetime import datetime, timezone

import pytest
from sqlalchemy import event, exc, func, select
from sqlalchemy.engine import make_url
from test_db_support import BACKENDS, ToggleProxy, temporary_database, with_port

from gateway.audit.writer import AuditWriter, encode_entry, event_row, insert_entries, make_entry
from gateway.db import make_async_engine, upgrade
from gateway.models import AuditEvent, AuditRecord
from scheduler.events import Event

EVENTS_PER_RECORD = 3


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


def record(number: int, **fields) -> dict:
    return {
        "id": f"req-{number:06d}",
        "tenant_id": 1,
        "model": "smollm2",
        "received_at": datetime(2026, 1, 1, tzinfo=timezone.utc).timestamp() + number,
        "status": "finished",
        "finish_reason": "stop",
        "prompt_tokens": 10,
        "completion_tokens": number % 50,
        **fields,
    }


def events(number: int) -> list[dict]:
    return [
        {"kind": "queued", "time": 0.0, "data": {"ahead": number % 7}},
        {"kind": "scheduled", "time": 0.5, "num_tokens": 10},  # flat form
        {"kind": "finished", "time": 1.25, "data": {"reason": "stop"}},
    ]


async def stored_counts(engine) -> tuple[int, int, int]:
    """(records, distinct record ids, events) in the database."""
    async with engine.connect() as connection:
        records = await connection.scalar(select(func.count()).select_from(AuditRecord))
        distinct = await connection.scalar(select(func.count(func.distinct(AuditRecord.id))))
        num_events = await connection.scalar(select(func.count()).select_from(AuditEvent))
    return records, distinct, num_events


async def assert_each_stored_once(engine, num_records: int) -> None:
    expected = (num_records, num_records, num_records * EVENTS_PER_RECORD)
    assert await stored_counts(engine) == expected


def new_writer(engine, tmp_path, **options) -> AuditWriter:
    options = {"flush_interval_s": 0.05, "retry_interval_s": 0.1, **options}
    writer = AuditWriter(engine, tmp_path / "audit.spool", **options)
    writer.start()
    return writer


# --- normalising submissions (no database) ----------------------------------------------------


def test_bad_records_are_refused_at_submit():
    with pytest.raises(ValueError, match="unknown"):
        make_entry(record(1, colour="blue"))
    with pytest.raises(ValueError, match="status"):
        make_entry(record(1, status=None))
    with pytest.raises(ValueError, match="time"):
        make_entry(record(1, finished_at=object()))


def test_events_are_accepted_nested_flat_or_as_scheduler_events():
    nested = event_row("r", 0, {"kind": "queued", "time": 1, "data": {"ahead": 3}})
    flat = event_row("r", 0, {"kind": "queued", "time": 1, "ahead": 3})
    typed = event_row("r", 0, Event("queued", 1.0, {"ahead": 3}))
    assert nested == flat == typed
    assert nested == {
        "request_id": "r",
        "seq": 0,
        "kind": "queued",
        "time": 1.0,
        "data": {"ahead": 3},
    }


def test_record_times_and_defaults_are_completed():
    entry = make_entry(record(1, first_token_at="2026-01-01T00:00:02+00:00"))
    assert entry.record["received_at"] == datetime(2026, 1, 1, 0, 0, 1, tzinfo=timezone.utc)
    assert entry.record["first_token_at"].second == 2
    assert (entry.record["num_preemptions_swap"], entry.record["preempted_time_s"]) == (0, 0.0)
    assert [row["seq"] for row in entry.events] == []


# --- writing ----------------------------------------------------------------------------------


async def test_records_are_written_in_bulk_batches(engine, tmp_path):
    writer = new_writer(engine, tmp_path, max_batch=200, flush_interval_s=0.2)
    for number in range(450):
        writer.submit(record(number), events(number))
    assert writer.stats.num_batches == 0  # submit only queues; nothing awaited yet
    await writer.flush()
    assert (writer.stats.num_batches, writer.stats.num_written) == (3, 450)
    await assert_each_stored_once(engine, 450)
    await writer.close()


async def test_a_lone_record_is_written_within_the_flush_interval(engine, tmp_path):
    writer = new_writer(engine, tmp_path, flush_interval_s=0.2)
    writer.submit(record(1), events(1))
    deadline = time.monotonic() + 3.0
    while (await stored_counts(engine))[0] == 0 and time.monotonic() < deadline:
        await asyncio.sleep(0.05)
    await assert_each_stored_once(engine, 1)
    await writer.close()


async def test_close_drains_everything(engine, tmp_path):
    writer = new_writer(engine, tmp_path, flush_interval_s=30.0, max_batch=1000)
    for number in range(300):
        writer.submit(record(number), events(number))
    await writer.close()
    await assert_each_stored_once(engine, 300)
    assert writer.num_pending == 0 and writer.num_spooled == 0
    with pytest.raises(RuntimeError):
        writer.submit(record(301))


async def test_submitting_the_same_request_twice_stores_it_once(engine, tmp_path):
    writer = new_writer(engine, tmp_path)
    writer.submit(record(1), events(1))
    writer.submit(record(1, status="aborted"), events(1))
    await writer.flush()
    writer.submit(record(1), events(1))
    await writer.close()
    await assert_each_stored_once(engine, 1)


# --- outages ----------------------------------------------------------------------------------


class SqliteOutage:
    """Makes every connection checkout fail, as if the database file were gone, until restored
    (the pool closes the connections it fails to hand out)."""

    def __init__(self, engine) -> None:
        self.is_down = False
        event.listen(engine.sync_engine, "checkout", self._checkout)

    def _checkout(self, dbapi_connection, connection_record, connection_proxy):
        if self.is_down:
            cause = sqlite3.OperationalError("unable to open database file (test outage)")
            raise exc.OperationalError("checkout", None, cause)

    async def cut(self) -> None:
        self.is_down = True

    async def restore(self) -> None:
        self.is_down = False


class PostgresOutage:
    """The writer reaches PostgreSQL through a proxy that can drop it."""

    def __init__(self, database_url: str) -> None:
        target = make_url(database_url)
        self.proxy = ToggleProxy(target.host, target.port or 5432)
        self.database_url = database_url
        self.engine = None

    async def start(self):
        await self.proxy.start()
        self.engine = make_async_engine(with_port(self.database_url, self.proxy.port))
        return self.engine

    async def cut(self) -> None:
        await self.proxy.cut()

    async def restore(self) -> None:
        await self.proxy.restore()

    async def close(self) -> None:
        await self.engine.dispose()
        await self.proxy.close()


@pytest.fixture
async def outage(database_url, engine):
    """(writer's engine, outage switch) for the backend under test."""
    if make_url(database_url).get_backend_name() == "sqlite":
        writer_engine = make_async_engine(database_url)
        yield writer_engine, SqliteOutage(writer_engine)
        await writer_engine.dispose()
        return
    postgres = PostgresOutage(database_url)
    yield await postgres.start(), postgres
    await postgres.close()


async def wait_until_replayed(writer: AuditWriter, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while writer.num_spooled and time.monotonic() < deadline:
        await asyncio.sleep(0.05)
    assert writer.num_spooled == 0


async def test_outage_spools_then_replays_each_record_once(engine, outage, tmp_path):
    writer_engine, switch = outage
    writer = new_writer(writer_engine, tmp_path)
    for number in range(100):
        writer.submit(record(number), events(number))
    await writer.flush()
    await switch.cut()
    for number in range(100, 600):
        writer.submit(record(number), events(number))
    await writer.flush()
    assert writer.num_spooled == 500 and writer.spool_path.stat().st_size > 0
    assert (await stored_counts(engine))[0] == 100
    await switch.restore()
    for number in range(600, 700):
        writer.submit(record(number), events(number))
    await writer.flush()
    await wait_until_replayed(writer)
    await writer.close()
    await assert_each_stored_once(engine, 700)
    assert writer.spool_path.stat().st_size == 0


async def test_spool_is_replayed_in_submission_order(engine, outage, tmp_path):
    writer_engine, switch = outage
    writer = new_writer(writer_engine, tmp_path, max_batch=7)
    await switch.cut()
    for number in range(50):
        writer.submit(record(number), events(number))
    await writer.flush()
    await switch.restore()
    await wait_until_replayed(writer)
    await writer.close()
    async with engine.connect() as connection:
        query = select(AuditEvent.request_id).where(AuditEvent.seq == 0).order_by(AuditEvent.id)
        order = (await connection.scalars(query)).all()
    assert order == [record(number)["id"] for number in range(50)]


async def test_outages_under_load_lose_and_duplicate_nothing(engine, outage, tmp_path):
    writer_engine, switch = outage
    writer = new_writer(writer_engine, tmp_path, max_batch=50)
    rng = random.Random(5)

    async def produce() -> None:
        for number in range(1500):
            writer.submit(record(number), events(number))
            if number % 10 == 0:
                await asyncio.sleep(0.002)

    async def flap() -> None:
        for _ in range(3):
            await asyncio.sleep(rng.uniform(0.05, 0.25))
            await switch.cut()
            await asyncio.sleep(rng.uniform(0.05, 0.25))
            await switch.restore()

    await asyncio.gather(produce(), flap())
    await writer.flush()
    await wait_until_replayed(writer)
    await writer.close()
    assert writer.stats.num_spooled > 0
    await assert_each_stored_once(engine, 1500)


async def test_close_during_an_outage_keeps_records_in_the_spool(engine, outage, tmp_path):
    writer_engine, switch = outage
    writer = new_writer(writer_engine, tmp_path)
    await switch.cut()
    for number in range(120):
        writer.submit(record(number), events(number))
    await writer.close()
    assert writer.num_spooled == 120
    await switch.restore()
    successor = new_writer(writer_engine, tmp_path)  # the next process finds the spool
    await successor.close()
    await assert_each_stored_once(engine, 120)
    assert successor.stats.num_replayed == 120


async def test_replay_after_partial_success_stores_each_record_once(engine, tmp_path):
    entries = [make_entry(record(number), events(number)) for number in range(300)]
    await insert_entries(engine, entries[:180])  # written, but the writer never heard back
    spool = tmp_path / "audit.spool"
    spool.write_text("".join(encode_entry(entry) for entry in entries) + '{"torn line')
    writer = new_writer(engine, tmp_path)
    await writer.close()
    await assert_each_stored_once(engine, 300)
    assert spool.stat().st_size == 0


# SQLite stores any value in any column, so only PostgreSQL refuses this row.
@pytest.mark.parametrize("database_url", ["postgresql"], indirect=True)
async def test_a_row_the_database_refuses_is_set_aside_alone(engine, tmp_path):
    writer = new_writer(engine, tmp_path)
    writer.submit(record(1), events(1))
    writer.submit(record(2, id="x" * 100), events(2))  # longer than the column
    writer.submit(record(3), events(3))
    await writer.close()
    await assert_each_stored_once(engine, 2)
    assert writer.stats.num_rejected == 1
    assert "x" * 100 in writer.rejected_path.read_text()
