"""Hostile input against a real `conveyor serve` (the tiny 2-layer model, so it starts in
seconds): every request, however malformed, gets an OpenAI-shaped JSON error with the right
status, never a 5xx, never a hang. The protocol-level cases (oversized headers, bad request
lines, unknown methods) go over a raw socket, since no HTTP client sends them."""

from __future__ import annotations

import json
import socket

import openai
import pytest
from test_server_support import (
    ServerProcess,
    create_tenant_with_key,
    server_env,
    serving,
    tiny_engine_args,
)

pytestmark = [pytest.mark.slow]

SERVED_NAMES = ["tiny", "tiny-alias"]
SOCKET_TIMEOUT_S = 10.0
ERROR_FIELDS = {"message", "type", "param", "code"}


@pytest.fixture(scope="module")
def server(tmp_path_factory, tiny_model_dir) -> ServerProcess:
    workdir = tmp_path_factory.mktemp("hostile-server")
    database_url = f"sqlite:///{workdir / 'conveyor.db'}"
    env = server_env(database_url, None, workdir)
    args = [*tiny_engine_args(tiny_model_dir), "--served-model-name", *SERVED_NAMES]
    server = ServerProcess(workdir, env, args, database_url=database_url)
    with serving(server):
        yield server


@pytest.fixture(scope="module")
def key(server) -> str:
    return create_tenant_with_key(server.database_url, "hostile")


# ---- a raw HTTP/1.1 exchange ---------------------------------------------------------------------
def exchange(server: ServerProcess, data: bytes) -> tuple[int, dict[str, str], bytes]:
    """Send bytes, read the whole answer (the server closes the connection); status, headers and
    body. A hang fails the test through the socket timeout."""
    with socket.create_connection(("127.0.0.1", server.port), timeout=SOCKET_TIMEOUT_S) as sock:
        sock.sendall(data)
        received = b""
        while chunk := sock.recv(65536):
            received += chunk
    head, _, body = received.partition(b"\r\n\r\n")
    status_line, *header_lines = head.decode("latin-1").split("\r\n")
    headers = {}
    for line in header_lines:
        name, _, value = line.partition(":")
        headers[name.strip().lower()] = value.strip()
    return int(status_line.split()[1]), headers, body


def request_bytes(
    method: str = "GET", target: str = "/v1/models", headers: dict[str, str] | None = None,
    body: bytes = b"",
) -> bytes:  # fmt: skip
    lines = [f"{method} {target} HTTP/1.1", "Host: 127.0.0.1", "Connection: close"]
    lines += [f"{name}: {value}" for name, value in (headers or {}).items()]
    if body:
        lines.append(f"Content-Length: {len(body)}")
    return ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1") + body


def assert_openai_error(status: int, headers: dict[str, str], body: bytes, expected: int):
    assert status == expected, body[:500]
    assert headers["content-type"].startswith("application/json")
    error = json.loads(body)["error"]
    assert set(error) == ERROR_FIELDS
    assert error["message"] and "Traceback" not in error["message"]
    return error


MANY_HEADERS = {f"x-filler-{i}": "1" for i in range(200)}

PROTOCOL_CASES = [
    # (name, raw request, status, code)
    ("100 kB header", request_bytes(headers={"x-big": "a" * 100_000}), 431, "request_header_fields_too_large"),
    ("200 headers", request_bytes(headers=MANY_HEADERS), 431, "request_header_fields_too_large"),
    ("20 kB URL", request_bytes(target="/v1/models?" + "a" * 20_000), 414, "uri_too_long"),
    ("unknown method", request_bytes(method="FROB"), 405, "method_not_allowed"),
    ("garbage where the method goes", b"\x00\x01garbage\r\n\r\n", 405, "method_not_allowed"),
    ("not HTTP at all", b"hello there\r\n\r\n", 405, "method_not_allowed"),
    ("unknown HTTP version", b"GET /v1/models HTTP/7.1\r\nHost: x\r\n\r\n", 400, "bad_request"),
    ("bad header line", b"GET /v1/models HTTP/1.1\r\nHost: x\r\nno colon here\r\n\r\n", 400, "bad_request"),
    ("bad content-length", request_bytes(headers={"Content-Length": "lots"}), 400, "bad_request"),
    ("unknown route", request_bytes(target="/v2/models"), 404, "not_found"),
    ("route outside the API", request_bytes(target="/wp-login.php"), 404, "not_found"),
    ("wrong method", request_bytes(method="DELETE", target="/healthz"), 405, "method_not_allowed"),
    ("a /v1 route without a key", request_bytes(target="/v1/embeddings"), 401, "missing_api_key"),
    ("admin without token", request_bytes(target="/admin/tenants"), 401, None),
]  # fmt: skip


@pytest.mark.parametrize(
    "raw, status, code", [c[1:] for c in PROTOCOL_CASES], ids=[c[0] for c in PROTOCOL_CASES]
)
def test_protocol_errors_are_openai_shaped(server, raw, status, code):
    got_status, headers, body = exchange(server, raw)
    error = assert_openai_error(got_status, headers, body, status)
    if code is not None:
        assert error["code"] == code
    assert headers.get("x-request-id")


def test_body_over_the_limit_is_413(server, key):
    body = json.dumps({"model": "tiny", "prompt": "a" * (2 << 20)}).encode()
    raw = request_bytes("POST", "/v1/completions", auth(key), body)
    error = assert_openai_error(*exchange(server, raw), 413)
    assert error["code"] == "request_too_large"


@pytest.mark.parametrize(
    "method, target, status", [("GET", "/v1/embeddings", 404), ("DELETE", "/v1/models", 405)]
)
def test_unknown_routes_and_methods_with_a_key(server, key, method, target, status):
    assert_openai_error(*exchange(server, request_bytes(method, target, auth(key))), status)


@pytest.mark.parametrize(
    "headers, body",
    [
        ({"Content-Encoding": "gzip", "Content-Length": "10"}, b"0123456789"),
        ({"Content-Encoding": "br", "Content-Length": "10"}, b"0123456789"),
        ({"Transfer-Encoding": "chunked"}, b"zz\r\nabc\r\n0\r\n\r\n"),
        ({"Transfer-Encoding": "chunked", "Content-Length": "5"}, b"0\r\n\r\n"),
    ],
    ids=["not gzip", "not brotli", "bad chunk size", "both lengths"],
)
def test_undecodable_bodies_are_400(server, key, headers, body):
    raw = request_bytes("POST", "/v1/completions", {**auth(key), **headers}) + body
    error = assert_openai_error(*exchange(server, raw), 400)
    assert error["code"] == "bad_request"


def test_a_gzip_bomb_is_413(server, key):
    import gzip

    bomb = gzip.compress(b" " * (50 << 20))  # 50 MiB of spaces in 50 kB
    headers = {**auth(key), "Content-Encoding": "gzip"}
    raw = request_bytes("POST", "/v1/completions", headers, bomb)
    assert_openai_error(*exchange(server, raw), 413)


def test_the_server_still_answers_after_the_hostile_cases(server, key):
    status, _, body = exchange(server, request_bytes(headers=auth(key)))
    assert status == 200 and json.loads(body)["data"]


# ---- hostile bodies -------------------------------------------------------------------------------
def auth(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}", "Content-Type": "application/json"}


def chat(**fields) -> bytes:
    body = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    return json.dumps({**body, **fields}).encode()


def completion(**fields) -> bytes:
    return json.dumps({"model": "tiny", "prompt": "hi", "max_tokens": 2, **fields}).encode()


CHAT, COMPLETIONS = "/v1/chat/completions", "/v1/completions"
USER = {"role": "user", "content": "hi"}
TOOL = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
JSON_SCHEMA = {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "object"}}}
NAMED_G = {"type": "function", "function": {"name": "g"}}
UNSUPPORTED_TOOL = {"type": "function", "function": {"name": "f", "parameters": {"if": {}}}}
CALL = {"id": "call_1", "type": "function", "function": {"name": "f", "arguments": "{}"}}
SCHEMA_PARAM = "response_format.json_schema.schema"


def schema_format(schema) -> dict:
    return {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}


DEEP = b'{"model": "tiny", "prompt": ' + b"[" * 5000 + b"]" * 5000 + b"}"

BODY_CASES = [
    # (name, path, body, status, code, param)
    ("tools", CHAT, chat(tools=[TOOL]), 200, None, None),
    ("tool_choice required without tools", CHAT, chat(tool_choice="required"), 400, None, "tool_choice"),
    ("a named tool_choice not among tools", CHAT, chat(tools=[TOOL], tool_choice=NAMED_G), 400, None, "tool_choice"),
    ("a tool without a function", CHAT, chat(tools=[{"type": "function"}]), 400, None, "tools.0.function"),
    ("tool parameters with an unsupported keyword", CHAT, chat(tools=[UNSUPPORTED_TOOL]), 400, "unsupported_schema_keyword", "tools.0.function.parameters"),
    ("functions", CHAT, chat(functions=[TOOL["function"]]), 400, "unsupported_parameter", "functions"),
    ("parallel_tool_calls", CHAT, chat(tools=[TOOL], parallel_tool_calls=False), 200, None, None),
    ("response_format json_schema", CHAT, chat(response_format=JSON_SCHEMA), 200, None, None),
    ("response_format json_object", CHAT, chat(response_format={"type": "json_object"}), 200, None, None),
    ("response_format on completions", COMPLETIONS, completion(response_format=JSON_SCHEMA), 200, None, None),
    ("an invalid schema", CHAT, chat(response_format=schema_format({"type": 5})), 400, "invalid_schema", SCHEMA_PARAM),
    ("an unsupported schema keyword", CHAT, chat(response_format=schema_format({"not": {}})), 400, "unsupported_schema_keyword", SCHEMA_PARAM),
    ("ignore_eos with a grammar", CHAT, chat(response_format={"type": "json_object"}, ignore_eos=True), 400, "invalid_value", "ignore_eos"),
    ("response_format json with tools", CHAT, chat(tools=[TOOL], response_format=JSON_SCHEMA), 400, None, "response_format"),
    ("audio", CHAT, chat(audio={"voice": "alloy", "format": "wav"}), 400, "unsupported_parameter", "audio"),
    ("modalities", CHAT, chat(modalities=["text", "audio"]), 400, "unsupported_parameter", "modalities"),
    ("prediction", CHAT, chat(prediction={"type": "content", "content": "x"}), 400, "unsupported_parameter", "prediction"),
    ("web_search_options", CHAT, chat(web_search_options={}), 400, "unsupported_parameter", "web_search_options"),
    ("store", CHAT, chat(store=True), 400, "unsupported_parameter", "store"),
    ("metadata", CHAT, chat(metadata={"a": "b"}), 400, "unsupported_parameter", "metadata"),
    ("an unknown field", CHAT, chat(frobnicate=1), 400, "unknown_parameter", "frobnicate"),
    ("logit_bias not a token id", CHAT, chat(logit_bias={"hello": 5}), 400, "unsupported_value", "logit_bias"),
    ("logit_bias out of range", COMPLETIONS, completion(logit_bias={"50": 500}), 400, "unsupported_value", "logit_bias"),
    ("logit_bias at all", CHAT, chat(logit_bias={"50": 5}), 400, "unsupported_value", "logit_bias"),
    ("user message without content", CHAT, chat(messages=[{"role": "user"}]), 400, None, "messages.0.content"),
    ("message with a name", CHAT, chat(messages=[{**USER, "name": "bob"}]), 400, "unsupported_parameter", "messages.0.name"),
    ("tool message", CHAT, chat(messages=[USER, {"role": "tool", "content": "x", "tool_call_id": "1"}]), 200, None, None),
    ("tool message without its call id", CHAT, chat(messages=[{"role": "tool", "content": "x"}]), 400, None, "messages.0.tool_call_id"),
    ("assistant tool_calls", CHAT, chat(messages=[USER, {"role": "assistant", "content": None, "tool_calls": [CALL]}]), 200, None, None),
    ("echo", COMPLETIONS, completion(echo=True), 400, "unsupported_value", "echo"),
    ("suffix", COMPLETIONS, completion(suffix="end"), 400, "unsupported_value", "suffix"),
    ("best_of 3", COMPLETIONS, completion(best_of=3), 400, "unsupported_value", "best_of"),
    ("stream_options unknown", CHAT, chat(stream=True, stream_options={"include_obfuscation": True}), 400, "unsupported_parameter", "stream_options.include_obfuscation"),
    ("NaN temperature", CHAT, chat(temperature=float("nan")), 400, None, None),  # not JSON
    ("Infinity top_p", CHAT, chat(top_p=float("inf")), 400, None, None),
    ("1e400 temperature", CHAT, chat().replace(b'"max_tokens"', b'"temperature": 1e400, "max_tokens"'), 400, None, "temperature"),
    ("huge max_tokens", COMPLETIONS, completion(max_tokens=10**30), 400, "context_length_exceeded", "prompt"),
    ("huge n", COMPLETIONS, completion(n=10**30), 400, None, "n"),
    ("huge top_k", COMPLETIONS, completion(top_k=10**30), 200, None, None),
    ("huge priority", CHAT, chat(priority=10**30), 400, None, "priority"),
    ("huge seed", CHAT, chat(seed=-(2**64)), 400, None, "seed"),
    ("huge stop_token_ids", CHAT, chat(stop_token_ids=[10**30]), 400, "invalid_value", "stop_token_ids"),
    ("token id over the vocabulary", COMPLETIONS, completion(prompt=[49152]), 400, None, "prompt"),
    ("max_tokens a bool", COMPLETIONS, completion(max_tokens=True), 400, None, "max_tokens"),
    ("n a string", COMPLETIONS, completion(n="2"), 400, None, "n"),
    ("n an integral float is an integer", COMPLETIONS, completion(n=2.0), 200, None, None),
    ("n a fraction", COMPLETIONS, completion(n=1.5), 400, None, "n"),
    ("echo 0 is not false", COMPLETIONS, completion(echo=0), 400, "unsupported_value", "echo"),
    ("top_logprobs without logprobs", CHAT, chat(top_logprobs=2), 400, None, "top_logprobs"),
    ("an empty stop sequence", CHAT, chat(stop=["x", ""]), 400, None, "stop.1"),
    ("17 stop sequences", CHAT, chat(stop=["x"] * 17), 400, None, "stop"),
    ("model a number", COMPLETIONS, completion(model=7), 400, None, "model"),
    ("messages an object", CHAT, chat(messages={"role": "user"}), 400, None, "messages"),
    ("deeply nested prompt", COMPLETIONS, DEEP, 400, None, None),
    ("non-UTF-8 inside a string", CHAT, b'{"model": "tiny", "messages": [{"role": "user", "content": "\xc3\x28"}]}', 400, None, None),
    ("lone surrogate escape", CHAT, b'{"model": "tiny", "messages": [{"role": "user", "content": "\\ud800"}], "max_tokens": 2}', 400, None, None),
    ("a text of no tokens", COMPLETIONS, completion(prompt=["\u0006", "hi"]), 200, None, None),
    ("too many prompts", COMPLETIONS, completion(prompt=["a"] * 33), 400, None, "prompt"),
    ("the most sequences, alone", COMPLETIONS, completion(prompt=["a"] * 32, n=8, max_tokens=1), 200, None, None),
    ("over-long prompt", COMPLETIONS, completion(prompt="hello " * 5000), 400, "context_length_exceeded", "prompt"),
    ("unknown model", COMPLETIONS, completion(model="gpt-4"), 404, "model_not_found", "model"),
    ("the directory name is not served", COMPLETIONS, completion(model="tiny-llama0"), 404, "model_not_found", "model"),
    ("response_format text is fine", CHAT, chat(response_format={"type": "text"}), 200, None, None),
    ("an empty logit_bias is fine", CHAT, chat(logit_bias={}), 200, None, None),
    ("echo false is fine", COMPLETIONS, completion(echo=False), 200, None, None),
]  # fmt: skip


async def post(server: ServerProcess, path: str, body: bytes, key: str):
    import io

    import aiohttp

    timeout = aiohttp.ClientTimeout(total=60)
    async with (
        aiohttp.ClientSession(timeout=timeout) as session,
        session.post(server.base_url + path, data=io.BytesIO(body), headers=auth(key)) as reply,
    ):
        return reply.status, reply.headers.copy(), await reply.read()


@pytest.mark.parametrize(
    "path, body, status, code, param",
    [c[1:] for c in BODY_CASES],
    ids=[c[0] for c in BODY_CASES],
)
async def test_hostile_bodies(server, key, path, body, status, code, param):
    got_status, headers, raw = await post(server, path, body, key)
    assert got_status == status, raw[:500]
    if status == 200:
        assert json.loads(raw)["choices"]
        return
    error = json.loads(raw)["error"]
    assert set(error) == ERROR_FIELDS and error["message"]
    assert (error["code"], error["param"]) == (code, param), error


# ---- --served-model-name --------------------------------------------------------------------------
def test_models_lists_every_served_name(server, key):
    with openai.OpenAI(base_url=server.base_url + "/v1", api_key=key, max_retries=0) as client:
        assert [model.id for model in client.models.list()] == SERVED_NAMES
        assert client.models.retrieve("tiny-alias").id == "tiny-alias"
        with pytest.raises(openai.NotFoundError):
            client.models.retrieve("tiny-llama0")


@pytest.mark.parametrize("name", SERVED_NAMES)
def test_each_served_name_answers_and_is_echoed(server, key, name):
    with openai.OpenAI(base_url=server.base_url + "/v1", api_key=key, max_retries=0) as client:
        completion = client.completions.create(model=name, prompt="hi", max_tokens=2)
        chat = client.chat.completions.create(
            model=name, messages=[{"role": "user", "content": "hi"}], max_tokens=2
        )
        stream = client.chat.completions.create(
            model=name, messages=[{"role": "user", "content": "hi"}], max_tokens=2, stream=True
        )
        chunks = list(stream)
    assert completion.model == chat.model == name
    assert chunks and all(chunk.model == name for chunk in chunks)
