"""Graceful shutdown of a real `conveyor serve` process (the tiny random Llama; SQLite with the
in-process Redis, and the real PostgreSQL with the real Redis): SIGTERM mid-stream turns
`/readyz` false at once, new requests get 503 + Retry-After, in-flight requests (streamed or
not) finish, or end with finish_reason "abort" after --drain-timeout, the process exits 0,
and every request, refused ones included, has exactly one audit record in the database.

PostgreSQL or Redis being down fails the PostgreSQL variant; it never skips."""

from __future__ import annotations

import asyncio
import signal
import time
from pathlib import Path

import openai
import pytest
import redis
from aiohttp import web
from test_db_support import temporary_database
from test_server_support import (
    ServerProcess,
    audit_records_of,
    create_tenant_with_key,
    get_json,
    real_service_urls,
    server_env,
    tiny_engine_args,
)

from gateway.appkeys import ENGINE_CLIENT, SERVING_STATE, ServingState
from gateway.lifecycle import Lifecycle, abort_engine_requests

pytestmark = [pytest.mark.slow]

REDIS_URL, POSTGRES_URL = real_service_urls()
NUM_STREAMS = 4
MAX_TOKENS = 160  # a few seconds on two CPU threads: long enough to be cut mid-stream
EXIT_TIMEOUT_S = 60.0


# ---- helpers ---------------------------------------------------------------------------------
def start_server(
    workdir: Path, database_url: str, redis_url: str | None, model_dir: Path, drain_s: float
) -> ServerProcess:
    env = server_env(database_url, redis_url, workdir)
    args = [*tiny_engine_args(model_dir), "--drain-timeout", str(drain_s)]
    return ServerProcess(workdir, env, args, database_url=database_url).start()


async def open_stream(client, model: str, index: int, started: asyncio.Event) -> list:
    stream = await client.chat.completions.create(
        model=model,
        messages=[{"role": "user", "content": f"Count to {index + 10}."}],
        max_tokens=MAX_TOKENS,
        stream=True,
        stream_options={"include_usage": True},
        extra_body={"ignore_eos": True},
    )
    chunks = []
    async for chunk in stream:
        chunks.append(chunk)
        if chunk.choices and chunk.choices[0].delta.content:
            started.set()
    return chunks


async def complete(client, model: str, max_tokens: int = MAX_TOKENS):
    return await client.completions.create(
        model=model,
        prompt="Once upon a time",
        max_tokens=max_tokens,
        extra_body={"ignore_eos": True},
    )


async def wait_for_inflight(server: ServerProcess, count: int, timeout_s: float = 20.0) -> None:
    """Until the replica counts `count` admitted sequences (so SIGTERM finds them running)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        state = await asyncio.to_thread(server.engine_state)
        if state["num_inflight_sequences"] == count:
            return
        await asyncio.sleep(0.05)
    raise AssertionError(f"{count} sequences never in flight: {state}")


def request_id_of(response_id: str) -> str:
    return response_id.split("-", 1)[1]  # "chatcmpl-<id>" / "cmpl-<id>"


def finish_reason_of(chunks: list) -> str | None:
    reasons = [c.choices[0].finish_reason for c in chunks if c.choices]
    return next((r for r in reasons if r), None)


async def refused(make_request) -> openai.APIStatusError:
    with pytest.raises(openai.APIStatusError) as caught:
        await make_request()
    return caught.value


def check_redis_is_up() -> None:
    with redis.Redis.from_url(REDIS_URL, socket_connect_timeout=2) as client:
        client.ping()


def stop_quietly(server: ServerProcess) -> None:
    if server.process is not None and server.process.poll() is None:
        server.process.kill()
        server.process.wait()


# ---- SIGTERM mid-stream ------------------------------------------------------------------------
@pytest.mark.parametrize("backend", ["sqlite", "postgresql"])
async def test_sigterm_mid_stream_drains_and_refuses_new_work(
    backend, tiny_model_dir, tmp_path, unique_name
):
    redis_url = None
    if backend == "postgresql":
        check_redis_is_up()
        redis_url = REDIS_URL
    with temporary_database(backend, tmp_path, POSTGRES_URL) as database_url:
        server = start_server(tmp_path, database_url, redis_url, tiny_model_dir, drain_s=60)
        try:
            await asyncio.to_thread(server.wait_ready)
            key = await asyncio.to_thread(create_tenant_with_key, database_url, unique_name)
            await drain_scenario(server, key, tiny_model_dir.name, database_url, unique_name)
        finally:
            stop_quietly(server)


async def drain_scenario(
    server: ServerProcess, key: str, model: str, database_url: str, tenant: str
) -> None:
    async with openai.AsyncOpenAI(
        base_url=server.base_url + "/v1", api_key=key, max_retries=0
    ) as client:
        plain = asyncio.create_task(complete(client, model))
        started = [asyncio.Event() for _ in range(NUM_STREAMS)]
        streams = [
            asyncio.create_task(open_stream(client, model, i, started[i]))
            for i in range(NUM_STREAMS)
        ]
        await asyncio.wait_for(asyncio.gather(*(e.wait() for e in started)), 30)
        await wait_for_inflight(server, NUM_STREAMS + 1)

        server.process.send_signal(signal.SIGTERM)
        signalled_at = time.monotonic()
        status, body = await asyncio.to_thread(get_json, server.base_url + "/readyz")
        assert status == 503 and body["checks"]["accepting"] is False
        assert time.monotonic() - signalled_at < 2.0
        refusals = [
            await refused(lambda: complete(client, model, 4)),
            await refused(lambda: open_stream(client, model, 99, asyncio.Event())),
        ]
        assert not any(task.done() for task in [plain, *streams]), "streams ended too early"
        server.process.send_signal(signal.SIGTERM)  # a second signal must not disturb the drain

        completion = await asyncio.wait_for(plain, 60)
        chunk_lists = await asyncio.wait_for(asyncio.gather(*streams), 60)
        exit_code = await asyncio.to_thread(server.process.wait, EXIT_TIMEOUT_S)

    log = server.log_text()
    assert exit_code == 0, log[-4000:]
    assert "already draining" in log
    for error in refusals:
        check_refusal(error)
    assert completion.choices[0].finish_reason == "length"
    assert completion.usage.completion_tokens == MAX_TOKENS
    for chunks in chunk_lists:
        assert finish_reason_of(chunks) == "length"
        assert chunks[-1].usage.completion_tokens == MAX_TOKENS
    finished_ids = [request_id_of(completion.id)]
    finished_ids += [request_id_of(chunks[0].id) for chunks in chunk_lists]
    refused_ids = [error.response.headers["x-request-id"] for error in refusals]
    check_audit_log(database_url, tenant, finished_ids, refused_ids)
    assert (
        not (server.workdir / "audit.spool").exists()
        or not (server.workdir / "audit.spool").read_text()
    )


def check_refusal(error: openai.APIStatusError) -> None:
    assert error.status_code == 503
    assert int(error.response.headers["Retry-After"]) >= 1
    assert error.response.headers["Connection"] == "close"  # go to another replica next time
    assert error.body["type"] == "server_error"
    assert error.body["code"] == "service_unavailable"
    assert set(error.body) == {"message", "type", "param", "code"}


def check_audit_log(
    database_url: str, tenant: str, finished_ids: list[str], refused_ids: list[str]
) -> None:
    records = {r["id"]: r for r in audit_records_of(database_url, tenant)}
    assert sorted(records) == sorted(finished_ids + refused_ids)  # one each, nothing else
    for request_id in finished_ids:
        record = records[request_id]
        assert (record["status"], record["finish_reason"]) == ("finished", "length")
        assert record["completion_tokens"] == MAX_TOKENS
    for request_id in refused_ids:
        record = records[request_id]
        assert (record["status"], record["refusal_reason"]) == ("rejected", "draining")


# ---- drain timeout -----------------------------------------------------------------------------
async def test_drain_timeout_aborts_what_is_left_and_records_it(
    tiny_model_dir, tmp_path, unique_name
):
    database_url = f"sqlite:///{tmp_path / 'conveyor.db'}"
    server = start_server(tmp_path, database_url, None, tiny_model_dir, drain_s=1)
    model = tiny_model_dir.name
    try:
        await asyncio.to_thread(server.wait_ready)
        key = await asyncio.to_thread(create_tenant_with_key, database_url, unique_name)
        async with openai.AsyncOpenAI(
            base_url=server.base_url + "/v1", api_key=key, max_retries=0
        ) as client:
            plain = asyncio.create_task(complete(client, model, max_tokens=900))
            started = asyncio.Event()
            stream = asyncio.create_task(open_stream_long(client, model, started))
            await asyncio.wait_for(started.wait(), 30)
            await wait_for_inflight(server, 2)
            server.process.send_signal(signal.SIGTERM)
            signalled_at = time.monotonic()
            completion, chunks = await asyncio.wait_for(asyncio.gather(plain, stream), 30)
            cut_after_s = time.monotonic() - signalled_at
            exit_code = await asyncio.to_thread(server.process.wait, EXIT_TIMEOUT_S)
    finally:
        stop_quietly(server)
    assert exit_code == 0, server.log_text()[-4000:]
    assert 0.9 < cut_after_s < 10.0
    assert completion.choices[0].finish_reason == "abort"
    assert finish_reason_of(chunks) == "abort"
    assert chunks[-1].usage.completion_tokens < 900
    records = audit_records_of(database_url, unique_name)
    assert sorted(r["id"] for r in records) == sorted(
        [request_id_of(completion.id), request_id_of(chunks[0].id)]
    )
    assert {(r["status"], r["finish_reason"]) for r in records} == {("aborted", "abort")}


async def open_stream_long(client, model: str, started: asyncio.Event) -> list:
    stream = await client.completions.create(
        model=model,
        prompt="Tell me a long story.",
        max_tokens=900,
        stream=True,
        stream_options={"include_usage": True},
        extra_body={"ignore_eos": True},
    )
    chunks = []
    async for chunk in stream:
        chunks.append(chunk)
        started.set()
    return chunks


# ---- the signal logic, in process --------------------------------------------------------------
def lifecycle_app() -> web.Application:
    app = web.Application()
    app[SERVING_STATE] = ServingState()
    return app


async def test_first_signal_drains_a_repeated_sigterm_is_ignored_a_second_sigint_aborts():
    app = lifecycle_app()
    lifecycle = Lifecycle(app, drain_timeout_s=30)
    lifecycle.on_signal(signal.SIGTERM)
    assert app[SERVING_STATE].is_draining and lifecycle.stop_requested.is_set()
    lifecycle.on_signal(signal.SIGTERM)
    assert not lifecycle.abort_requested.is_set()
    lifecycle.on_signal(signal.SIGINT)
    assert lifecycle.abort_requested.is_set()
    lifecycle.on_signal(signal.SIGINT)  # and a third is harmless


async def test_drain_waits_for_in_flight_work_and_stops_early_on_abort():
    app = lifecycle_app()
    lifecycle = Lifecycle(app, drain_timeout_s=30)
    app[SERVING_STATE].num_inflight_sequences = 2
    asyncio.get_running_loop().call_later(
        0.1, setattr, app[SERVING_STATE], "num_inflight_sequences", 0
    )
    assert await lifecycle.wait_for_inflight(5.0, stop_on_abort=True)
    app[SERVING_STATE].num_inflight_sequences = 1
    assert not await lifecycle.wait_for_inflight(0.1, stop_on_abort=True)
    lifecycle.abort_requested.set()
    started = time.monotonic()
    assert not await lifecycle.wait_for_inflight(30.0, stop_on_abort=True)
    assert time.monotonic() - started < 1.0


class FakeEngine:
    def __init__(self, request_ids):
        self.open_streams = list(request_ids)
        self.aborted = []

    def abort_all(self):
        self.aborted += self.open_streams
        return len(self.open_streams)


def test_abort_engine_requests_aborts_every_open_stream():
    app = lifecycle_app()
    assert abort_engine_requests(app) == 0  # no engine yet (a signal during the model load)
    app[ENGINE_CLIENT] = FakeEngine(["a-0", "b-0", "b-1"])
    assert abort_engine_requests(app) == 3
    assert app[ENGINE_CLIENT].aborted == ["a-0", "b-0", "b-1"]
