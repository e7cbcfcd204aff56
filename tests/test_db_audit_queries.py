"""Audit queries for the admin API on SQLite and the real PostgreSQL: filters, cursor
pagination, one request with its events, tenant isolation, pruning."""

from __future__ import annotations

from datetime import datetime, timedelta, timezone

import pytest
from test_db_support import BACKENDS, temporary_database

from gateway.audit.queries import get_request, list_requests, prune
from gateway.audit.writer import insert_entries, make_entry
from gateway.db import make_async_engine, make_sessionmaker, upgrade

START = datetime(2026, 3, 1, 12, 0, tzinfo=timezone.utc)


@pytest.fixture(params=BACKENDS)
def database_url(request, tmp_path, postgres_url):
    with temporary_database(request.param, tmp_path, postgres_url) as url:
        upgrade(url)
        yield url


@pytest.fixture
async def sessionmaker(database_url):
    engine = make_async_engine(database_url)
    await insert_entries(engine, [make_entry(*fixture) for fixture in FIXTURE_REQUESTS])
    yield make_sessionmaker(engine)
    await engine.dispose()


def request_fixture(number: int) -> tuple[dict, list[dict]]:
    """Twenty requests: two tenants, three statuses, priorities 0-2, one second apart except
    that numbers 10-13 share one instant (ties are ordered by id)."""
    second = 10 if 10 <= number <= 13 else number
    record = {
        "id": f"r-{number:02d}",
        "tenant_id": 1 if number % 2 == 0 else 2,
        "received_at": START + timedelta(seconds=second),
        "status": ("finished", "aborted", "refused")[number % 3],
        "effective_priority": number % 3,
        "requested_priority": 0,
        "queue_time_s": number / 10,
        "num_preemptions_swap": 1 if number % 5 == 0 else 0,
        "num_preemptions_recompute": 1 if number == 7 else 0,
    }
    # Events stored out of order: the query orders them by seq.
    events = [
        {"seq": 2, "kind": "finished", "time": 3.0, "data": {}},
        {"seq": 0, "kind": "queued", "time": 1.0, "data": {"ahead": 4, "tenants": ["acme"]}},
        {"seq": 1, "kind": "scheduled", "time": 2.0, "data": {}},
    ]
    return record, events


FIXTURE_REQUESTS = [request_fixture(number) for number in range(20)]


async def listed_ids(sessionmaker, **filters) -> list[str]:
    async with sessionmaker() as session:
        page = await list_requests(session, limit=100, **filters)
    assert page.next_cursor is None
    return [item.id for item in page.items]


def expected_ids(predicate) -> list[str]:
    chosen = [record for record, _ in FIXTURE_REQUESTS if predicate(record)]
    chosen.sort(key=lambda record: (record["received_at"], record["id"]), reverse=True)
    return [record["id"] for record in chosen]


@pytest.mark.parametrize(
    ("filters", "predicate"),
    [
        ({}, lambda r: True),
        ({"tenant_id": 2}, lambda r: r["tenant_id"] == 2),
        ({"status": "refused"}, lambda r: r["status"] == "refused"),
        ({"status": ["refused", "aborted"]}, lambda r: r["status"] != "finished"),
        ({"priority": 0}, lambda r: r["effective_priority"] == 0),
        ({"min_queue_time_s": 1.5}, lambda r: r["queue_time_s"] >= 1.5),
        (
            {"preempted_only": True},
            lambda r: r["num_preemptions_swap"] + r["num_preemptions_recompute"],
        ),
        (
            {
                "received_after": START + timedelta(seconds=5),
                "received_before": START + timedelta(seconds=11),
            },
            lambda r: (
                START + timedelta(seconds=5) <= r["received_at"] < START + timedelta(seconds=11)
            ),
        ),
        (
            {"tenant_id": 1, "status": "finished", "preempted_only": True},
            lambda r: (
                r["tenant_id"] == 1 and r["status"] == "finished" and r["num_preemptions_swap"]
            ),
        ),
    ],
)
async def test_filters(sessionmaker, filters, predicate):
    assert await listed_ids(sessionmaker, **filters) == expected_ids(predicate)


async def test_cursor_pagination_walks_every_record_once_newest_first(sessionmaker):
    seen, cursor = [], None
    async with sessionmaker() as session:
        while True:
            page = await list_requests(session, cursor=cursor, limit=3)
            assert len(page.items) <= 3
            seen.extend(item.id for item in page.items)
            cursor = page.next_cursor
            if cursor is None:
                break
    assert seen == expected_ids(lambda r: True)


async def test_pagination_keeps_its_filters(sessionmaker):
    async with sessionmaker() as session:
        first = await list_requests(session, tenant_id=1, limit=4)
        second = await list_requests(session, tenant_id=1, limit=4, cursor=first.next_cursor)
    ids = [item.id for item in first.items + second.items]
    assert ids == expected_ids(lambda r: r["tenant_id"] == 1)[:8]


async def test_an_invalid_cursor_is_refused(sessionmaker):
    async with sessionmaker() as session:
        for cursor in ("garbage!", "bm90IGpzb24", "WzFd"):
            with pytest.raises(ValueError, match="cursor"):
                await list_requests(session, cursor=cursor)


async def test_get_request_returns_the_row_and_its_events_in_order(sessionmaker):
    async with sessionmaker() as session:
        detail = await get_request(session, "r-07")
    assert detail.record.id == "r-07" and detail.record.num_preemptions_recompute == 1
    assert detail.record.received_at == START + timedelta(seconds=7)
    assert [event.kind for event in detail.events] == ["queued", "scheduled", "finished"]
    assert detail.events[0].data == {"ahead": 4, "tenants": ["acme"]}


async def test_a_tenant_sees_only_its_own_requests(sessionmaker):
    async with sessionmaker() as session:
        assert await get_request(session, "r-07", tenant_id=2) is not None
        assert await get_request(session, "r-07", tenant_id=1) is None
        assert await get_request(session, "missing") is None


async def test_prune_deletes_old_records_and_their_events(sessionmaker):
    now = START + timedelta(days=30, seconds=10)
    async with sessionmaker.begin() as session:
        assert await prune(session, older_than_days=30, now=now) == 10  # r-00 .. r-09
    remaining = await listed_ids(sessionmaker)
    assert sorted(remaining) == [f"r-{number:02d}" for number in range(10, 20)]
    async with sessionmaker() as session:
        assert await get_request(session, "r-05") is None
        assert len((await get_request(session, "r-15")).events) == 3
