"""Audit retention: with `--audit-retention-days`, each replica prunes older audit records
(and their events) a random minute after it starts, then every hour. Deleting is idempotent,
so replicas sharing one database need no coordination."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
from collections.abc import AsyncIterator

from aiohttp import web

from gateway.appkeys import SESSIONMAKER, SETTINGS

log = logging.getLogger(__name__)

FIRST_PRUNE_WITHIN_S = 60.0  # spread replicas that start together
PRUNE_INTERVAL_S = 3600.0


async def audit_retention_ctx(app: web.Application) -> AsyncIterator[None]:
    days = app[SETTINGS].audit_retention_days
    task = None
    if days is not None:
        first_delay_s = random.uniform(0.0, FIRST_PRUNE_WITHIN_S)
        task = asyncio.create_task(
            prune_periodically(app[SESSIONMAKER], days, first_delay_s), name="audit-retention"
        )
    yield
    if task is not None:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task


async def prune_periodically(
    sessionmaker, days: float, first_delay_s: float, interval_s: float = PRUNE_INTERVAL_S
) -> None:
    await asyncio.sleep(first_delay_s)
    while True:
        await prune_once(sessionmaker, days)
        await asyncio.sleep(interval_s)


async def prune_once(sessionmaker, days: float) -> int:
    """Delete records older than `days`; a failure is logged and tried again next time."""
    from gateway.audit.queries import prune

    try:
        async with sessionmaker.begin() as session:
            num_deleted = await prune(session, days)
    except Exception:
        log.warning("audit retention: pruning failed", exc_info=True)
        return 0
    if num_deleted:
        log.info("audit retention: deleted %d records older than %g days", num_deleted, days)
    return num_deleted
