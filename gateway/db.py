"""Database URLs, engines and sessions, and Alembic upgrades run from Python.

People write plain URLs (`postgresql://user@host/db`, `postgres://...`, `sqlite:///path`,
`sqlite:///:memory:`); the drivers are the project's choice: psycopg 3 for PostgreSQL (sync and
async), the standard `sqlite3` module for sync SQLite and aiosqlite for async SQLite.
"""

from __future__ import annotations

import asyncio
import json
import os
from pathlib import Path
from typing import Any

from alembic import command
from alembic.config import Config
from alembic.runtime.migration import MigrationContext
from sqlalchemy import Engine, create_engine, event, text
from sqlalchemy.engine import URL, make_url
from sqlalchemy.ext.asyncio import (
    AsyncEngine,
    AsyncSession,
    async_sessionmaker,
    create_async_engine,
)
from sqlalchemy.pool import NullPool

DEFAULT_DATABASE_URL = "sqlite:///conveyor.db"
DATABASE_URL_ENV = "CONVEYOR_DATABASE_URL"
MIGRATIONS_DIR = Path(__file__).resolve().parent.parent / "migrations"

_SYNC_DRIVERS = {"postgresql": "postgresql+psycopg", "sqlite": "sqlite"}
_ASYNC_DRIVERS = {"postgresql": "postgresql+psycopg", "sqlite": "sqlite+aiosqlite"}
_BACKEND_ALIASES = {"postgres": "postgresql", "postgresql": "postgresql", "sqlite": "sqlite"}


def database_url_from_env() -> str:
    return os.environ.get(DATABASE_URL_ENV) or DEFAULT_DATABASE_URL


def parse_database_url(url: str | URL) -> URL:
    """The URL with its driver removed (`postgresql` or `sqlite`); ValueError if unsupported."""
    parsed = make_url(url.strip() if isinstance(url, str) else url)
    backend = _BACKEND_ALIASES.get(parsed.get_backend_name())
    if backend is None:
        shown = parsed.render_as_string(hide_password=True)
        raise ValueError(f"unsupported database URL {shown!r}: use postgresql:// or sqlite://")
    return parsed.set(drivername=backend)


def sync_url(url: str | URL) -> URL:
    parsed = parse_database_url(url)
    return parsed.set(drivername=_SYNC_DRIVERS[parsed.drivername])


def async_url(url: str | URL) -> URL:
    parsed = parse_database_url(url)
    return parsed.set(drivername=_ASYNC_DRIVERS[parsed.drivername])


def _sqlite_file(url: URL) -> Path | None:
    database = url.database
    if not database or database == ":memory:" or database.startswith("file:"):
        return None
    return Path(database)


def _ensure_sqlite_dir(url: URL) -> None:
    path = _sqlite_file(url)
    if path is not None:
        path.parent.mkdir(parents=True, exist_ok=True)


def json_dumps(value: Any) -> str:
    """JSON for JSON columns; values JSON cannot express (enums, sets, ...) become strings."""
    return json.dumps(value, default=str)


def _engine_options(url: URL, options: dict[str, Any]) -> dict[str, Any]:
    connect_args = dict(options.pop("connect_args", {}))
    options.setdefault("json_serializer", json_dumps)
    if url.get_backend_name() == "sqlite":
        connect_args.setdefault("timeout", 15)  # seconds to wait for another writer's lock
        return {"connect_args": connect_args, **options}
    options.setdefault("pool_pre_ping", True)  # drop connections a restart or outage killed
    if "connect_timeout" not in url.query:
        connect_args.setdefault("connect_timeout", 5)
    return {"connect_args": connect_args, **options}


def _on_sqlite_connect(dbapi_connection: Any, _record: Any) -> None:
    cursor = dbapi_connection.cursor()
    cursor.execute("PRAGMA foreign_keys=ON")
    cursor.execute("PRAGMA journal_mode=WAL")
    cursor.execute("PRAGMA synchronous=NORMAL")
    cursor.close()


def _prepare_engine(engine: Engine, url: URL) -> None:
    if url.get_backend_name() == "sqlite" and _sqlite_file(url) is not None:
        event.listen(engine, "connect", _on_sqlite_connect)


def make_async_engine(url: str | URL, **options: Any) -> AsyncEngine:
    """An async engine for any accepted URL; keyword options go to `create_async_engine`."""
    url = async_url(url)
    _ensure_sqlite_dir(url)
    engine = create_async_engine(url, **_engine_options(url, options))
    _prepare_engine(engine.sync_engine, url)
    return engine


def make_sync_engine(url: str | URL, **options: Any) -> Engine:
    url = sync_url(url)
    _ensure_sqlite_dir(url)
    engine = create_engine(url, **_engine_options(url, options))
    _prepare_engine(engine, url)
    return engine


def make_sessionmaker(engine: AsyncEngine) -> async_sessionmaker[AsyncSession]:
    """Sessions whose objects stay readable after commit (no lazy reloads under asyncio)."""
    return async_sessionmaker(engine, expire_on_commit=False)


async def check_database(engine: AsyncEngine, timeout_s: float = 2.0) -> bool:
    """True when a trivial query succeeds within the timeout (for `/readyz`)."""
    try:
        await asyncio.wait_for(_select_one(engine), timeout_s)
    except Exception:
        return False
    return True


async def _select_one(engine: AsyncEngine) -> None:
    async with engine.connect() as connection:
        await connection.execute(text("SELECT 1"))


def alembic_config(url: str | URL) -> Config:
    """Alembic configuration for `migrations/`, aimed at `url` (sync driver)."""
    config = Config(str(MIGRATIONS_DIR / "alembic.ini"))
    config.set_main_option("script_location", str(MIGRATIONS_DIR))
    config.attributes["database_url"] = sync_url(url)
    config.attributes["configure_logger"] = False
    return config


def upgrade(url: str | URL, revision: str = "head") -> None:
    """Migrate the database to `revision` (blocking: call through a thread from async code)."""
    _ensure_sqlite_dir(sync_url(url))
    command.upgrade(alembic_config(url), revision)


def downgrade(url: str | URL, revision: str) -> None:
    """Migrate the database down to `revision` (`base` removes every table)."""
    command.downgrade(alembic_config(url), revision)


def current_revision(url: str | URL) -> str | None:
    engine = make_sync_engine(url, poolclass=NullPool)
    try:
        with engine.connect() as connection:
            return MigrationContext.configure(connection).get_current_revision()
    finally:
        engine.dispose()
