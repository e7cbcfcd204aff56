"""End to end on the embedded defaults: a real `conveyor serve` process (SQLite file, in-process
fakeredis, SmolLM2) driven by the official `openai` client (sync, async, streaming) and by raw
HTTP for what the client cannot send: malformed requests, disconnects, slow readers."""

from __future__ import annotations

import asyncio
import io
import json
import sqlite3
import time

import aiohttp
import openai
import pytest
from test_server_support import ENGINE_ARGS as SERVER_ARGS
from test_server_support import (
    MODEL_NAME,
    ServerProcess,
    create_tenant_with_key,
    server_env,
    serving,
)

pytestmark = [pytest.mark.slow, pytest.mark.real_model]

GREEDY_PROMPT = "The capital of France is"


# ---- the server and its tenants ---------------------------------------------------------------
@pytest.fixture(scope="session")
def embedded_server(tmp_path_factory) -> ServerProcess:
    workdir = tmp_path_factory.mktemp("embedded-server")
    database_url = f"sqlite:///{workdir / 'conveyor.db'}"
    env = server_env(database_url, None, workdir)
    server = ServerProcess(workdir, env, SERVER_ARGS, database_url=database_url)
    with serving(server):
        yield server


@pytest.fixture(scope="session")
def demo_key(embedded_server) -> str:
    key = embedded_server.demo_key()
    assert key, embedded_server.log_text()
    return key


@pytest.fixture(scope="session")
def client(embedded_server, demo_key):
    with openai.OpenAI(
        base_url=embedded_server.base_url + "/v1", api_key=demo_key, max_retries=0
    ) as sync_client:
        yield sync_client


def client_for(server: ServerProcess, key: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.base_url + "/v1", api_key=key, max_retries=0)


async def post_raw(server, path, body: bytes, headers: dict[str, str], timeout_s=30.0):
    timeout = aiohttp.ClientTimeout(total=timeout_s)
    async with (
        aiohttp.ClientSession(timeout=timeout) as session,
        session.post(server.base_url + path, data=io.BytesIO(body), headers=headers) as response,
    ):
        return response.status, response.headers.copy(), await response.read()


def auth(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}", "Content-Type": "application/json"}


# ---- first start ------------------------------------------------------------------------------
def test_first_start_prints_the_demo_key_once_with_a_curl_line(embedded_server, demo_key):
    log = embedded_server.log_text()
    assert log.count(demo_key) == 2  # the key line and the curl line
    assert f"curl http://127.0.0.1:{embedded_server.port}/v1/chat/completions" in log
    assert f"Authorization: Bearer {demo_key}" in log


# ---- the openai client: sync ------------------------------------------------------------------
def test_models_lists_the_served_model(client):
    models = client.models.list()
    assert [model.id for model in models.data] == [MODEL_NAME]
    assert client.models.retrieve(MODEL_NAME).id == MODEL_NAME


def test_chat_completion_reports_usage_and_request_id(client):
    raw = client.chat.completions.with_raw_response.create(
        model=MODEL_NAME, messages=[{"role": "user", "content": "Say hi"}], max_tokens=4
    )
    completion = raw.parse()
    assert raw.headers["x-request-id"] in completion.id
    choice = completion.choices[0]
    assert choice.message.role == "assistant"
    assert choice.finish_reason in ("length", "stop")
    assert completion.usage.completion_tokens <= 4
    assert completion.usage.total_tokens == (
        completion.usage.prompt_tokens + completion.usage.completion_tokens
    )


def test_completion_with_n_and_seed_is_reproducible(client):
    def ask():
        return client.completions.create(
            model=MODEL_NAME, prompt="Once upon a time", max_tokens=4, n=3, seed=7
        )

    first, second = ask(), ask()
    assert [c.index for c in first.choices] == [0, 1, 2]
    assert [c.text for c in first.choices] == [c.text for c in second.choices]
    assert first.usage.completion_tokens <= 3 * 4
    assert first.usage.prompt_tokens == second.usage.prompt_tokens


def test_greedy_stream_matches_the_non_streamed_answer(client):
    messages = [{"role": "user", "content": "Name a colour."}]
    full = client.chat.completions.create(
        model=MODEL_NAME, messages=messages, max_tokens=6, temperature=0
    )
    chunks = list(
        client.chat.completions.create(
            model=MODEL_NAME,
            messages=messages,
            max_tokens=6,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == full.choices[0].message.content
    assert chunks[0].choices[0].delta.role == "assistant"
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].choices == []
    assert chunks[-1].usage.completion_tokens == full.usage.completion_tokens == 6


def test_stop_string_ends_the_completion_without_the_stop_text(client):
    completion = client.completions.create(
        model=MODEL_NAME, prompt=GREEDY_PROMPT, max_tokens=12, temperature=0, stop=["Paris"]
    )
    choice = completion.choices[0]
    assert choice.finish_reason == "stop"
    assert "Paris" not in choice.text


def test_completion_logprobs_have_the_legacy_shape(client):
    completion = client.completions.create(
        model=MODEL_NAME, prompt=GREEDY_PROMPT, max_tokens=3, temperature=0, logprobs=2
    )
    logprobs = completion.choices[0].logprobs
    assert len(logprobs.tokens) == len(logprobs.token_logprobs) == 3
    assert all(len(top) == 2 for top in logprobs.top_logprobs)
    assert logprobs.text_offset[0] == 0
    assert "".join(logprobs.tokens) == completion.choices[0].text


def test_top_logprobs_under_a_grammar_list_only_tokens_it_allows(client):
    """Under a JSON schema most tokens are masked out: asked for 15, each position lists the
    tokens the grammar allowed (maybe fewer), every logprob a number (-inf was sent as null)."""
    completion = client.completions.create(
        model=MODEL_NAME, prompt="A JSON object:", max_tokens=8, temperature=0, logprobs=15,
        extra_body={"response_format": {"type": "json_object"}},
    )  # fmt: skip
    logprobs = completion.choices[0].logprobs
    assert logprobs.top_logprobs and all(1 <= len(top) <= 15 for top in logprobs.top_logprobs)
    values = [lp for top in logprobs.top_logprobs for lp in top.values()]
    assert all(isinstance(lp, float) and lp <= 0 for lp in values)
    assert any(len(top) < 15 for top in logprobs.top_logprobs)  # the opening "{" stands alone


def test_chat_logprobs_have_the_chat_shape(client):
    completion = client.chat.completions.create(
        model=MODEL_NAME,
        messages=[{"role": "user", "content": "Hello"}],
        max_tokens=3,
        logprobs=True,
        top_logprobs=2,
        temperature=0,
    )
    content = completion.choices[0].logprobs.content
    assert len(content) == completion.usage.completion_tokens
    assert all(len(entry.top_logprobs) == 2 and entry.logprob <= 0 for entry in content)
    assert content[0].top_logprobs[0].logprob >= content[0].top_logprobs[1].logprob


def test_extensions_pass_through(client):
    completion = client.completions.create(
        model=MODEL_NAME,
        prompt="1, 2, 3,",
        max_tokens=5,
        extra_body={"top_k": 5, "min_p": 0.05, "repetition_penalty": 1.1, "ignore_eos": True},
        presence_penalty=0.5,
        frequency_penalty=0.5,
        top_p=0.9,
        user="someone",
    )
    assert completion.usage.completion_tokens == 5
    assert completion.choices[0].finish_reason == "length"


def test_streamed_completion_with_n_and_logprobs(client):
    chunks = list(
        client.completions.create(
            model=MODEL_NAME,
            prompt=GREEDY_PROMPT,
            max_tokens=3,
            n=2,
            logprobs=1,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    finished = [c.choices[0] for c in chunks if c.choices and c.choices[0].finish_reason]
    assert sorted(choice.index for choice in finished) == [0, 1]
    assert chunks[-1].usage.completion_tokens == 6


# ---- the openai client: async -----------------------------------------------------------------
async def test_async_client_runs_requests_concurrently(embedded_server, demo_key):
    async with openai.AsyncOpenAI(
        base_url=embedded_server.base_url + "/v1", api_key=demo_key, max_retries=0
    ) as client:
        completions = await asyncio.gather(
            *[
                client.chat.completions.create(
                    model=MODEL_NAME,
                    messages=[{"role": "user", "content": f"Count to {i}"}],
                    max_tokens=3,
                )
                for i in range(3)
            ]
        )
        stream = await client.completions.create(
            model=MODEL_NAME, prompt=GREEDY_PROMPT, max_tokens=3, stream=True
        )
        texts = [chunk.choices[0].text async for chunk in stream]
    assert len({c.id for c in completions}) == 3
    assert all(c.usage.completion_tokens <= 3 for c in completions)
    assert texts and all(isinstance(text, str) for text in texts)


# ---- bad input: a table -----------------------------------------------------------------------
def completion_body(**fields) -> bytes:
    return json.dumps({"model": MODEL_NAME, "prompt": "hi", "max_tokens": 2, **fields}).encode()


def chat_body(**fields) -> bytes:
    body = {"model": MODEL_NAME, "messages": [{"role": "user", "content": "hi"}], **fields}
    return json.dumps(body).encode()


COMPLETIONS = "/v1/completions"
CHAT = "/v1/chat/completions"
TOO_LONG_PROMPT = list(range(100, 1200))  # over --max-model-len 1024

MALFORMED = [
    # (name, path, body, expected status, expected code, expected param)
    ("invalid json", COMPLETIONS, b"{not json", 400, None, None),
    ("empty body", COMPLETIONS, b"", 400, None, None),
    ("json array", COMPLETIONS, b"[1, 2]", 400, None, None),
    ("json null", CHAT, b"null", 400, None, None),
    ("not utf-8", COMPLETIONS, b"\xff\xfe{}", 400, None, None),
    ("missing model", COMPLETIONS, b'{"prompt": "hi"}', 400, None, "model"),
    ("missing prompt", COMPLETIONS, json.dumps({"model": MODEL_NAME}).encode(), 400, None, "prompt"),
    ("missing messages", CHAT, json.dumps({"model": MODEL_NAME}).encode(), 400, None, "messages"),
    ("empty messages", CHAT, chat_body(messages=[]), 400, None, "messages"),
    ("messages not a list", CHAT, chat_body(messages="hi"), 400, None, "messages"),
    ("unknown role", CHAT, chat_body(messages=[{"role": "wizard", "content": "x"}]), 400, None, "messages.0.role"),
    ("image content", CHAT, chat_body(messages=[{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]), 400, None, "messages.0.content.0.type"),
    ("temperature a string", COMPLETIONS, completion_body(temperature="hot"), 400, None, "temperature"),
    ("temperature too high", COMPLETIONS, completion_body(temperature=3.5), 400, None, "temperature"),
    ("negative max_tokens", COMPLETIONS, completion_body(max_tokens=-1), 400, None, "max_tokens"),
    ("max_tokens a float", COMPLETIONS, completion_body(max_tokens=2.5), 400, None, "max_tokens"),
    ("n too large", COMPLETIONS, completion_body(n=9), 400, None, "n"),
    ("top_p zero", COMPLETIONS, completion_body(top_p=0), 400, None, "top_p"),
    ("stream a string", COMPLETIONS, completion_body(stream="yes"), 400, None, "stream"),
    ("empty stop", COMPLETIONS, completion_body(stop=[""]), 400, None, "stop.0"),
    ("logprobs too many", COMPLETIONS, completion_body(logprobs=21), 400, None, "logprobs"),
    ("top_logprobs alone", CHAT, chat_body(top_logprobs=2), 400, None, "top_logprobs"),
    ("seed too large", COMPLETIONS, completion_body(seed=2**70), 400, None, "seed"),
    ("token id out of vocab", COMPLETIONS, completion_body(prompt=[10**9]), 400, None, "prompt"),
    ("negative token id", COMPLETIONS, completion_body(prompt=[-1]), 400, None, "prompt.0"),
    ("empty prompt", COMPLETIONS, completion_body(prompt=""), 400, None, "prompt"),
    ("prompt over context", COMPLETIONS, completion_body(prompt=TOO_LONG_PROMPT), 400, "context_length_exceeded", "prompt"),
    ("prompt + max_tokens over context", COMPLETIONS, completion_body(prompt=[100] * 1000, max_tokens=100), 400, "context_length_exceeded", "prompt"),
    ("chat over context", CHAT, chat_body(messages=[{"role": "user", "content": "hello " * 1100}]), 400, "context_length_exceeded", "messages"),
    ("echo unsupported", COMPLETIONS, completion_body(echo=True), 400, "unsupported_value", "echo"),
    ("unknown model", COMPLETIONS, json.dumps({"model": "gpt-4", "prompt": "hi"}).encode(), 404, "model_not_found", "model"),
    ("unknown route", "/v1/embeddings", completion_body(), 404, "not_found", None),
    ("body over --max-body-bytes", COMPLETIONS, completion_body(prompt="a" * (1 << 20)), 413, "request_too_large", None),
]  # fmt: skip


@pytest.mark.parametrize(
    "path, body, status, code, param",
    [case[1:] for case in MALFORMED],
    ids=[case[0] for case in MALFORMED],
)
async def test_malformed_request_gets_an_openai_error(
    embedded_server, demo_key, path, body, status, code, param
):
    got_status, headers, raw = await post_raw(embedded_server, path, body, auth(demo_key))
    error = json.loads(raw)["error"]
    assert got_status == status, error
    assert set(error) == {"message", "type", "param", "code"}
    assert error["message"] and "Traceback" not in error["message"]
    assert (error["code"], error["param"]) == (code, param)
    assert headers.get("x-request-id")


@pytest.mark.parametrize(
    "headers, code",
    [
        ({}, "missing_api_key"),
        ({"Authorization": "Bearer cvy_not-a-real-key"}, "invalid_api_key"),
        ({"Authorization": "Basic dXNlcjpwYXNz"}, "missing_api_key"),
    ],
)
async def test_missing_or_bad_key_is_401(embedded_server, headers, code):
    status, response_headers, raw = await post_raw(embedded_server, CHAT, chat_body(), headers)
    assert status == 401
    assert json.loads(raw)["error"]["code"] == code
    assert response_headers.get("x-request-id")


def test_the_openai_client_raises_typed_errors(client):
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="nope", prompt="hi", max_tokens=2)
    with pytest.raises(openai.BadRequestError) as caught:
        client.completions.create(model=MODEL_NAME, prompt=TOO_LONG_PROMPT, max_tokens=2)
    assert caught.value.code == "context_length_exceeded"


# ---- tenants: rate limits, quotas, priorities --------------------------------------------------
def test_requests_over_the_rate_limit_get_429_with_headers(embedded_server):
    key = create_tenant_with_key(embedded_server.database_url, "limited", rpm=1)
    with client_for(embedded_server, key) as limited:
        raw = limited.models.with_raw_response.list()
        assert raw.headers["x-ratelimit-limit-requests"] == "1"
        assert raw.headers["x-ratelimit-remaining-requests"] == "0"
        with pytest.raises(openai.RateLimitError) as caught:
            limited.chat.completions.create(
                model=MODEL_NAME, messages=[{"role": "user", "content": "hi"}], max_tokens=2
            )
    assert caught.value.code == "rate_limit_exceeded"
    assert int(caught.value.response.headers["Retry-After"]) >= 1
    assert caught.value.response.headers["x-ratelimit-remaining-requests"] == "0"


def test_unused_reserved_tokens_are_refunded(embedded_server):
    key = create_tenant_with_key(embedded_server.database_url, "quota", daily_token_quota=300)
    with client_for(embedded_server, key) as quota:
        with pytest.raises(openai.RateLimitError) as caught:
            quota.completions.create(model=MODEL_NAME, prompt=GREEDY_PROMPT, max_tokens=400)
        assert caught.value.code == "insufficient_quota"
        for _ in range(3):  # each reserves ~205 of 300: passes only if the last one was refunded
            completion = quota.completions.create(
                model=MODEL_NAME,
                prompt=GREEDY_PROMPT,
                max_tokens=200,
                temperature=0,
                stop=["Paris"],
            )
            assert completion.usage.completion_tokens < 5


def test_priority_is_clamped_to_the_tenant_maximum_and_recorded(embedded_server):
    key = create_tenant_with_key(
        embedded_server.database_url, "clamped", default_priority=5, max_priority=2
    )
    with client_for(embedded_server, key) as clamped:

        def priority_of(**extra) -> tuple[str, str]:
            raw = clamped.completions.with_raw_response.create(
                model=MODEL_NAME, prompt="hi", max_tokens=1, **extra
            )
            return raw.headers["x-conveyor-priority"], raw.headers["x-request-id"]

        assert priority_of()[0] == "5"
        assert priority_of(extra_body={"priority": 9})[0] == "9"
        priority, request_id = priority_of(extra_body={"priority": 0})
    assert priority == "2"
    record = wait_for_audit_record(embedded_server, request_id)
    assert record == (0, 2, "finished")


async def test_concurrency_limit_holds_a_lease_per_running_request(embedded_server):
    key = await asyncio.to_thread(
        create_tenant_with_key, embedded_server.database_url, "single", max_concurrency=1
    )
    async with aiohttp.ClientSession() as session:
        running = await open_stream(session, embedded_server, key, max_tokens=200)
        status, headers, raw = await post_raw(embedded_server, CHAT, chat_body(), auth(key))
        assert (status, json.loads(raw)["error"]["code"]) == (429, "rate_limit_exceeded")
        assert headers["Retry-After"]
        running.close()
    await asyncio.to_thread(embedded_server.wait_for_idle_kv)
    status, _, raw = await post_raw(embedded_server, CHAT, chat_body(max_tokens=1), auth(key))
    assert status == 200, raw


def wait_for_audit_record(server, request_id: str, timeout_s: float = 10.0):
    path = server.database_url.removeprefix("sqlite:///")
    query = "SELECT requested_priority, effective_priority, status FROM audit_records WHERE id = ?"
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        with sqlite3.connect(path) as connection:
            row = connection.execute(query, (request_id,)).fetchone()
        connection.close()
        if row is not None:
            return row
        time.sleep(0.1)
    raise AssertionError(f"no audit record for {request_id}")


# ---- disconnects, slow readers, overload ------------------------------------------------------
async def open_stream(session, server, key, n=1, max_tokens=300):
    body = chat_body(max_tokens=max_tokens, ignore_eos=True, stream=True, n=n)
    response = await session.post(server.base_url + CHAT, data=body, headers=auth(key))
    assert response.status == 200
    first_event = await response.content.readuntil(b"\n\n")
    assert first_event.startswith(b"data: ")
    return response


async def test_client_disconnect_mid_stream_frees_every_kv_block(embedded_server, demo_key):
    async with aiohttp.ClientSession() as session:
        response = await open_stream(session, embedded_server, demo_key, n=2)
        for _ in range(4):
            await response.content.readuntil(b"\n\n")
        assert embedded_server.engine_state()["num_used_gpu_blocks"] > 0
        request_id = response.headers["x-request-id"]
        response.close()  # drop the connection mid-stream
    state = await asyncio.to_thread(embedded_server.wait_for_idle_kv)
    assert state["num_used_gpu_blocks"] == 0
    assert state["num_running"] == state["num_waiting"] == 0
    record = await asyncio.to_thread(wait_for_audit_record, embedded_server, request_id)
    assert record[2] == "aborted"


async def test_client_disconnect_before_a_full_response_aborts_it(embedded_server, demo_key):
    body = completion_body(max_tokens=800, ignore_eos=True)
    with pytest.raises(asyncio.TimeoutError):
        await post_raw(embedded_server, COMPLETIONS, body, auth(demo_key), timeout_s=1.0)
    state = await asyncio.to_thread(embedded_server.wait_for_idle_kv)
    assert state["num_used_gpu_blocks"] == 0
    assert state["num_inflight_sequences"] == 0


async def test_a_slow_reader_does_not_stall_other_requests(embedded_server, demo_key):
    async with aiohttp.ClientSession() as session:
        unread = await open_stream(session, embedded_server, demo_key, max_tokens=400)
        started = time.monotonic()
        status, _, raw = await post_raw(
            embedded_server, COMPLETIONS, completion_body(max_tokens=3), auth(demo_key)
        )
        assert status == 200, raw
        assert time.monotonic() - started < 20
        unread.close()
    await asyncio.to_thread(embedded_server.wait_for_idle_kv)


async def test_overload_answers_503_with_retry_after(embedded_server, demo_key):
    """--max-num-seqs 8 and --max-waiting-requests 8: two n=8 streams fill the line."""
    async with aiohttp.ClientSession() as session:
        streams = [await open_stream(session, embedded_server, demo_key, n=8) for _ in range(2)]
        status, headers, raw = await post_raw(
            embedded_server, COMPLETIONS, completion_body(), auth(demo_key)
        )
        for stream in streams:
            stream.close()
    assert status == 503
    assert int(headers["Retry-After"]) >= 1
    assert json.loads(raw)["error"]["type"] == "server_error"
    state = await asyncio.to_thread(embedded_server.wait_for_idle_kv)
    assert state["num_used_gpu_blocks"] == 0


# ---- probes -----------------------------------------------------------------------------------
def test_probes_answer_without_a_key(embedded_server):
    assert embedded_server.get_status("/healthz") == 200
    assert embedded_server.get_status("/readyz") == 200
    assert embedded_server.get_status("/admin/engine") == 401
