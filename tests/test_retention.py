"""`--audit-retention-days`: the pruning task of `conveyor serve`, on SQLite."""

from __future__ import annotations

import asyncio
from datetime import datetime, timedelta, timezone
from types import SimpleNamespace

from aiohttp import web
from sqlalchemy import select

from gateway.appkeys import SESSIONMAKER, SETTINGS
from gateway.audit.retention import audit_retention_ctx, prune_once, prune_periodically
from gateway.audit.writer import insert_entries, make_entry
from gateway.db import make_async_engine, make_sessionmaker, upgrade
from gateway.models import AuditRecord


async def audit_db(tmp_path, ages_days: list[float]):
    url = f"sqlite:///{tmp_path / 'audit.db'}"
    await asyncio.to_thread(upgrade, url)
    engine = make_async_engine(url)
    now = datetime.now(timezone.utc)
    records = [
        {"id": f"r{i}", "received_at": now - timedelta(days=age), "status": "finished"}
        for i, age in enumerate(ages_days)
    ]
    await insert_entries(engine, [make_entry(record, []) for record in records])
    return engine, make_sessionmaker(engine)


async def remaining_ids(sessionmaker) -> list[str]:
    async with sessionmaker() as session:
        return sorted((await session.scalars(select(AuditRecord.id))).all())


async def test_prune_once_deletes_only_records_past_the_retention(tmp_path):
    engine, sessionmaker = await audit_db(tmp_path, [0.1, 10, 45, 400])
    try:
        assert await prune_once(sessionmaker, 30) == 2
        assert await remaining_ids(sessionmaker) == ["r0", "r1"]
        assert await prune_once(sessionmaker, 30) == 0
    finally:
        await engine.dispose()


async def test_the_periodic_task_prunes(tmp_path):
    engine, sessionmaker = await audit_db(tmp_path, [1, 2, 3])
    task = asyncio.create_task(prune_periodically(sessionmaker, 1.5, 0.0, interval_s=0.05))
    try:
        for _ in range(100):
            if await remaining_ids(sessionmaker) == ["r0"]:
                break
            await asyncio.sleep(0.02)
        assert await remaining_ids(sessionmaker) == ["r0"]
        assert not task.done()
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        await engine.dispose()


class UnreachableDatabase:
    def begin(self):
        raise ConnectionRefusedError("database down")


async def test_a_failed_prune_is_logged_not_raised(caplog):
    assert await prune_once(UnreachableDatabase(), 30) == 0
    assert "pruning failed" in caplog.text


async def test_no_retention_no_task(tmp_path):
    app = web.Application()
    app[SETTINGS] = SimpleNamespace(audit_retention_days=None)
    app[SESSIONMAKER] = None
    tasks_before = asyncio.all_tasks()
    context = audit_retention_ctx(app)
    await anext(context)
    assert asyncio.all_tasks() == tasks_before
    await anext(context, None)
