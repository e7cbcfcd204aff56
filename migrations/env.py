"""Alembic environment: the URL comes from `config.attributes["database_url"]` (set by
`gateway.db.alembic_config`), else `CONVEYOR_DATABASE_URL`, else the embedded SQLite default.
A caller may also hand over an open sync connection in `config.attributes["connection"]`."""

from __future__ import annotations

from logging.config import fileConfig

from alembic import context
from sqlalchemy.engine import Connection
from sqlalchemy.pool import NullPool

from gateway.db import database_url_from_env, make_sync_engine, sync_url
from gateway.models import Base

config = context.config
if config.config_file_name and config.attributes.get("configure_logger", True):
    fileConfig(config.config_file_name, disable_existing_loggers=False)

target_metadata = Base.metadata


def database_url() -> str:
    return config.attributes.get("database_url") or database_url_from_env()


def configure(connection: Connection) -> None:
    context.configure(
        connection=connection,
        target_metadata=target_metadata,
        render_as_batch=connection.dialect.name == "sqlite",
        compare_type=True,
    )
    with context.begin_transaction():
        context.run_migrations()


def run_migrations_offline() -> None:
    context.configure(
        url=sync_url(database_url()), target_metadata=target_metadata, literal_binds=True
    )
    with context.begin_transaction():
        context.run_migrations()


def run_migrations_online() -> None:
    connection = config.attributes.get("connection")
    if connection is not None:
        configure(connection)
        return
    engine = make_sync_engine(database_url(), poolclass=NullPool)
    try:
        with engine.connect() as connection:
            configure(connection)
    finally:
        engine.dispose()


if context.is_offline_mode():
    run_migrations_offline()
else:
    run_migrations_online()
