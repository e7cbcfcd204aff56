"""Helpers for the SQL tests (no tests here): a throwaway database on SQLite or on the real
PostgreSQL (a fresh schema per test, dropped afterwards), and a TCP proxy that can cut the
connection to PostgreSQL and restore it."""

from __future__ import annotations

import asyncio
import contextlib
import uuid
from collections.abc import Iterator
from pathlib import Path

import psycopg
from sqlalchemy.engine import make_url

BACKENDS = ("sqlite", "postgresql")


@contextlib.contextmanager
def temporary_database(backend: str, tmp_path: Path, postgres_url: str) -> Iterator[str]:
    """A plain URL of an empty database; PostgreSQL being down fails the test (never skips)."""
    if backend == "sqlite":
        yield f"sqlite:///{tmp_path / 'conveyor.db'}"
        return
    schema = f"test_{uuid.uuid4().hex[:12]}"
    with psycopg.connect(postgres_url, autocommit=True) as connection:
        connection.execute(f'CREATE SCHEMA "{schema}"')
    try:
        yield with_search_path(postgres_url, schema)
    finally:
        with psycopg.connect(postgres_url, autocommit=True) as connection:
            connection.execute(f'DROP SCHEMA "{schema}" CASCADE')


def with_search_path(postgres_url: str, schema: str) -> str:
    url = make_url(postgres_url).update_query_dict({"options": f"-csearch_path={schema}"})
    return url.render_as_string(hide_password=False)


def with_port(postgres_url: str, port: int) -> str:
    url = make_url(postgres_url).set(host="127.0.0.1", port=port)
    return url.render_as_string(hide_password=False)


class ToggleProxy:
    """Forwards 127.0.0.1:<port> to a target; `cut()` drops every connection and refuses new
    ones (like a database going away), `restore()` listens again on the same port."""

    def __init__(self, target_host: str, target_port: int):
        self._target = (target_host, target_port)
        self._server: asyncio.Server | None = None
        self._writers: set[asyncio.StreamWriter] = set()
        self.port = 0

    async def start(self) -> None:
        self._server = await asyncio.start_server(self._serve, "127.0.0.1", self.port)
        self.port = self._server.sockets[0].getsockname()[1]

    async def cut(self) -> None:
        assert self._server is not None
        self._server.close()
        await self.cut_connections()
        await self._server.wait_closed()

    async def cut_connections(self) -> None:
        for writer in list(self._writers):
            writer.transport.abort()
        self._writers.clear()

    async def restore(self) -> None:
        await self.start()

    async def close(self) -> None:
        await self.cut()

    async def _serve(self, client_reader, client_writer) -> None:
        try:
            server_reader, server_writer = await asyncio.open_connection(*self._target)
        except OSError:
            client_writer.transport.abort()
            return
        self._writers.update((client_writer, server_writer))
        if self._server is None or not self._server.is_serving():  # cut while connecting
            await self.cut_connections()
        await asyncio.gather(
            _pipe(client_reader, server_writer), _pipe(server_reader, client_writer)
        )
        self._writers.difference_update((client_writer, server_writer))


async def _pipe(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    try:
        while data := await reader.read(65536):
            writer.write(data)
            await writer.drain()
    except (ConnectionError, OSError):
        pass
    finally:
        writer.transport.abort()
