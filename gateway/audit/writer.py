"""The audit writer: a background task that never blocks serving and never loses a record.

`AuditWriter.submit` only appends to an in-memory buffer. A task writes batches (up to
`max_batch` records, or whatever arrived within `flush_interval_s` of the first) with bulk
inserts that ignore rows already present, so writing a record twice stores it once. When the
database cannot be reached, batches go to an append-only JSON-lines spool file (fsync per batch);
while the spool holds anything, new batches are appended behind it and the spool is replayed in
order, every `retry_interval_s`, once the database answers again.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import time
from collections import deque
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from sqlalchemy import exc
from sqlalchemy.dialects import postgresql, sqlite
from sqlalchemy.ext.asyncio import AsyncEngine

from gateway.models import (
    AUDIT_RECORD_COLUMNS,
    AUDIT_TIME_COLUMNS,
    AuditEvent,
    AuditRecord,
)

log = logging.getLogger(__name__)


REQUIRED_RECORD_FIELDS = ("id", "received_at", "status")


RECORD_DEFAULTS = {
    "preempted_time_s": 0.0,
    "num_preemptions_swap": 0,
    "num_preemptions_recompute": 0,
}


_NESTED_EVENT_KEYS = frozenset({"kind", "time", "seq", "data"})


_OUTAGE_ERRORS = (
    exc.OperationalError,
    exc.InterfaceError,
    exc.DisconnectionError,
    exc.TimeoutError,
    asyncio.TimeoutError,
    OSError,
)


@dataclass(slots=True)
class AuditEntry:
    """One request: its full audit_records row and its audit_events rows."""

    record: dict[str, Any]
    events: list[dict[str, Any]]


def make_entry(record: Mapping[str, Any], events: Iterable[Any] = ()) -> AuditEntry:
    """Validate and complete a submitted record; ValueError on unknown or missing fields."""
    unknown = record.keys() - AUDIT_RECORD_COLUMNS
    if unknown:
        raise ValueError(f"unknown audit record fields: {sorted(unknown)}")
    missing = [name for name in REQUIRED_RECORD_FIELDS if record.get(name) is None]
    if missing:
        raise ValueError(f"audit record lacks {missing}")
    row = dict.fromkeys(AUDIT_RECORD_COLUMNS)
    row.update(record)
    for name, default in RECORD_DEFAULTS.items():
        if row[name] is None:
            row[name] = default
    for name in AUDIT_TIME_COLUMNS:
        row[name] = as_datetime(row[name])
    rows = [event_row(row["id"], seq, event) for seq, event in enumerate(events)]
    return AuditEntry(row, rows)


def event_row(request_id: str, seq: int, event: Any) -> dict[str, Any]:
    """An audit_events row from `{"kind", "time", "data"}`, or from a flat dict such as
    `scheduler.events.Event.to_dict()` whose keys other than kind/time/seq are the data."""
    fields = event if isinstance(event, Mapping) else event.to_dict()
    nested = fields.keys() <= _NESTED_EVENT_KEYS and isinstance(fields.get("data"), Mapping)
    if nested:
        data = dict(fields["data"])
    else:
        data = {key: value for key, value in fields.items() if key not in ("kind", "time", "seq")}
    return {
        "request_id": request_id,
        "seq": int(fields.get("seq", seq)),
        "kind": str(fields["kind"]),
        "time": float(fields["time"]),
        "data": data,
    }


def as_datetime(value: Any) -> datetime | None:
    """datetime as given; numbers as Unix seconds; strings as ISO 8601. Naive means UTC."""
    if value is None or isinstance(value, datetime):
        return value
    if isinstance(value, (int, float)):
        return datetime.fromtimestamp(value, timezone.utc)
    if isinstance(value, str):
        return datetime.fromisoformat(value)
    raise ValueError(f"not a time: {value!r}")


def _json_default(value: Any) -> Any:
    return value.isoformat() if isinstance(value, datetime) else str(value)


def encode_entry(entry: AuditEntry) -> str:
    line = {"record": entry.record, "events": entry.events}
    return json.dumps(line, default=_json_default, separators=(",", ":")) + "\n"


def decode_entry(line: str) -> AuditEntry:
    fields = json.loads(line)
    record = fields["record"]
    for name in AUDIT_TIME_COLUMNS:
        record[name] = as_datetime(record.get(name))
    return AuditEntry(record, fields["events"])


def append_lines(path: Path, lines: list[str]) -> None:
    with path.open("a", encoding="utf-8") as spool:
        spool.writelines(lines)
        spool.flush()
        os.fsync(spool.fileno())


def read_entries(path: Path, offset: int, max_entries: int) -> tuple[list[AuditEntry], int]:
    """Up to `max_entries` entries from byte `offset`, and the offset after them. A torn last
    line (a crash mid-append) or an unreadable one is logged and skipped."""
    entries: list[AuditEntry] = []
    with path.open("rb") as spool:
        spool.seek(offset)
        while len(entries) < max_entries:
            line = spool.readline()
            if not line:
                break
            try:
                entries.append(decode_entry(line.decode("utf-8")))
            except (ValueError, KeyError, TypeError):
                log.error("skipping unreadable audit spool line at byte %d", offset)
            offset += len(line)
    return entries, offset


def count_lines(path: Path) -> int:
    if not path.exists():
        return 0
    with path.open("rb") as spool:
        return sum(1 for _ in spool)


def truncate(path: Path) -> None:
    with path.open("w", encoding="utf-8") as spool:
        os.fsync(spool.fileno())


@dataclass(slots=True)
class WriterStats:
    num_submitted: int = 0
    num_written: int = 0  # records sent to the database in committed batches (replays included)
    num_batches: int = 0  # committed batch transactions
    num_spooled: int = 0  # records ever appended to the spool
    num_replayed: int = 0  # records written from the spool
    num_rejected: int = 0  # records the database refused on their own (see the .rejected file)


class AuditWriter:
    def __init__(
        self,
        engine: AsyncEngine,
        spool_path: str | os.PathLike[str],
        *,
        max_batch: int = 200,
        flush_interval_s: float = 0.2,
        retry_interval_s: float = 1.0,
        write_timeout_s: float = 10.0,
    ):
        self._engine = engine
        self.spool_path = Path(spool_path)
        self.rejected_path = self.spool_path.with_name(self.spool_path.name + ".rejected")
        self._max_batch = max_batch
        self._flush_interval_s = flush_interval_s
        self._retry_interval_s = retry_interval_s
        self._write_timeout_s = write_timeout_s
        self.stats = WriterStats()
        self._pending: deque[AuditEntry] = deque()
        self._wakeup = asyncio.Event()
        self._batch_ready = asyncio.Event()
        self._progress = asyncio.Condition()
        self._num_handled = 0  # submitted entries now in the database, the spool or rejected
        self._num_spooled_now = 0  # entries in the spool not yet replayed
        self._spool_offset = 0
        self._last_replay_at = float("-inf")
        self._closing = False
        self._task: asyncio.Task[None] | None = None

    @property
    def num_pending(self) -> int:
        return self.stats.num_submitted - self._num_handled

    @property
    def num_spooled(self) -> int:
        return self._num_spooled_now

    def start(self) -> None:
        """Start the background task on the running loop (replays a spool left from before)."""
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._run(), name="audit-writer")

    def submit(self, record: Mapping[str, Any], events: Iterable[Any] = ()) -> None:
        """Queue one request's record and events; never blocks. ValueError on a bad record."""
        if self._closing:
            raise RuntimeError("the audit writer is closed")
        self._pending.append(make_entry(record, events))
        self.stats.num_submitted += 1
        self._wakeup.set()
        if len(self._pending) >= self._max_batch:
            self._batch_ready.set()

    async def flush(self) -> None:
        """Wait until everything submitted so far is in the database or the spool."""
        target = self.stats.num_submitted
        self._batch_ready.set()
        await self._wait_handled(target)

    async def close(self) -> None:
        """Drain: write or spool everything submitted, then stop."""
        self.start()
        self._closing = True
        self._wakeup.set()
        self._batch_ready.set()
        assert self._task is not None
        await self._task

    async def _wait_handled(self, target: int) -> None:
        task = self._task
        if task is None:
            raise RuntimeError("the audit writer was never started")
        async with self._progress:
            await self._progress.wait_for(lambda: self._num_handled >= target or task.done())
        if self._num_handled < target:
            raise RuntimeError("the audit writer stopped before writing everything")

    async def _run(self) -> None:
        self._num_spooled_now = await asyncio.to_thread(count_lines, self.spool_path)
        if self._num_spooled_now:
            await self._replay()
        while not (self._closing and not self._pending):
            batch = await self._next_batch()
            if batch:
                await self._store(batch)
                await self._mark_handled(len(batch))
            elif self._is_replay_due():
                await self._replay()
        if self._num_spooled_now:
            await self._replay()

    async def _next_batch(self) -> list[AuditEntry]:
        if not self._pending:
            idle_timeout = self._retry_interval_s if self._num_spooled_now else None
            await _wait_event(self._wakeup, idle_timeout)
        if self._pending and len(self._pending) < self._max_batch and not self._closing:
            await _wait_event(self._batch_ready, self._flush_interval_s)
        self._wakeup.clear()
        self._batch_ready.clear()
        size = min(len(self._pending), self._max_batch)
        return [self._pending.popleft() for _ in range(size)]

    async def _mark_handled(self, count: int) -> None:
        async with self._progress:
            self._num_handled += count
            self._progress.notify_all()

    async def _store(self, batch: list[AuditEntry]) -> None:
        if not self._num_spooled_now and await self._write_batch(batch):
            return
        await self._spool(batch)
        if self._is_replay_due():
            await self._replay()

    def _is_replay_due(self) -> bool:
        elapsed = time.monotonic() - self._last_replay_at
        return self._num_spooled_now > 0 and elapsed >= self._retry_interval_s

    async def _spool(self, batch: list[AuditEntry]) -> None:
        if not self._num_spooled_now:
            self._last_replay_at = time.monotonic()  # the database just failed: wait to retry
        lines = [encode_entry(entry) for entry in batch]
        await asyncio.to_thread(append_lines, self.spool_path, lines)
        self._num_spooled_now += len(batch)
        self.stats.num_spooled += len(batch)

    async def _replay(self) -> None:
        """Write the spool to the database in order, batch by batch, until done or it fails."""
        self._last_replay_at = time.monotonic()
        while self._num_spooled_now:
            entries, offset = await asyncio.to_thread(
                read_entries, self.spool_path, self._spool_offset, self._max_batch
            )
            if entries and not await self._write_batch(entries):
                return
            self._spool_offset = offset
            self.stats.num_replayed += len(entries)
            self._num_spooled_now = max(self._num_spooled_now - len(entries), 0)
            if not entries:
                self._num_spooled_now = 0
        await asyncio.to_thread(truncate, self.spool_path)
        self._spool_offset = 0
        log.info("audit spool replayed into the database")

    async def _write_batch(self, entries: list[AuditEntry]) -> bool:
        """True once every entry is stored (or rejected on its own); False on an outage."""
        try:
            await self._insert(entries)
        except Exception as error:
            if is_outage(error):
                log.warning("audit database unreachable, spooling: %s", error)
                return False
            return await self._write_one_by_one(entries)
        return True

    async def _write_one_by_one(self, entries: list[AuditEntry]) -> bool:
        for entry in entries:
            try:
                await self._insert([entry])
            except Exception as error:
                if is_outage(error):
                    return False
                await self._reject(entry, error)
        return True

    async def _insert(self, entries: list[AuditEntry]) -> None:
        await asyncio.wait_for(insert_entries(self._engine, entries), self._write_timeout_s)
        self.stats.num_batches += 1
        self.stats.num_written += len(entries)

    async def _reject(self, entry: AuditEntry, error: Exception) -> None:
        log.error("audit record %s refused by the database: %s", entry.record["id"], error)
        await asyncio.to_thread(append_lines, self.rejected_path, [encode_entry(entry)])
        self.stats.num_rejected += 1


async def _wait_event(event: asyncio.Event, timeout_s: float | None) -> None:
    with contextlib.suppress(asyncio.TimeoutError):
        await asyncio.wait_for(event.wait(), timeout_s)


def is_outage(error: BaseException) -> bool:
    """Errors that mean "the database is not reachable now", as opposed to a bad row."""
    if isinstance(error, exc.DBAPIError) and error.connection_invalidated:
        return True
    return isinstance(error, _OUTAGE_ERRORS)


async def insert_entries(engine: AsyncEngine, entries: Sequence[AuditEntry]) -> None:
    """Insert records and their events in one transaction, skipping rows already stored."""
    dialect = postgresql if engine.dialect.name == "postgresql" else sqlite
    events = [event for entry in entries for event in entry.events]
    async with engine.begin() as connection:
        records = dialect.insert(AuditRecord).on_conflict_do_nothing()
        await connection.execute(records, [entry.record for entry in entries])
        if events:
            await connection.execute(dialect.insert(AuditEvent).on_conflict_do_nothing(), events)
