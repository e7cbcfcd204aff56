# ruff: noqa: F811 (the fixtures of test_openai_embedded, imported, are the arguments here)
"""Structured outputs and tool calls end to end: a real `conveyor serve` on SmolLM2 driven by
the official `openai` client. Schema answers validate over seeds and temperatures, json_object
answers parse, tool calls (required, named, auto) parse and validate and stream as deltas that
reassemble, tool results come back as `tool` messages, and the audit trail and metrics say the
request was constrained."""

from __future__ import annotations

import json
import sqlite3
import time
import urllib.request

import jsonschema
import openai
import pytest
from test_openai_embedded import client, demo_key, embedded_server  # noqa: F401 (fixtures)
from test_server_support import MODEL_NAME, create_tenant_with_key

pytestmark = [pytest.mark.slow, pytest.mark.real_model]

CITY = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 30},
        "country": {"type": "string", "maxLength": 30},
        "population": {"type": "integer", "minimum": 0},
    },
    "required": ["city", "country", "population"],
    "additionalProperties": False,
}
WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The current weather in a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 30},
                           "unit": {"enum": ["celsius", "fahrenheit"]}},
            "required": ["city", "unit"],
        },
    },
}  # fmt: skip
TIME_TOOL = {
    "type": "function",
    "function": {"name": "get_time", "parameters": {"type": "object", "properties": {}}},
}
ASK_WEATHER = [{"role": "user", "content": "What is the weather in Paris right now?"}]


def city_format() -> dict:
    return {"type": "json_schema", "json_schema": {"name": "city", "schema": CITY, "strict": True}}


@pytest.mark.parametrize("temperature", [0.0, 0.6, 1.0, 1.4])
def test_json_schema_answers_validate_over_seeds(client, temperature):
    for seed in range(3):
        response = client.chat.completions.create(
            model=MODEL_NAME,
            messages=[{"role": "user", "content": "Describe a big city as JSON."}],
            response_format=city_format(),
            temperature=temperature,
            seed=seed,
            max_tokens=60,
        )
        choice = response.choices[0]
        if choice.finish_reason == "stop":
            jsonschema.validate(json.loads(choice.message.content), CITY)
        else:
            assert choice.finish_reason == "length"


def test_json_object_parses_and_completions_take_response_format(client):
    response = client.chat.completions.create(
        model=MODEL_NAME,
        messages=[{"role": "user", "content": "Give me a JSON object about dogs."}],
        response_format={"type": "json_object"},
        temperature=0.0,
        max_tokens=80,
    )
    if response.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(response.choices[0].message.content), dict)
    completion = client.completions.create(
        model=MODEL_NAME,
        prompt="A city as JSON:",
        max_tokens=60,
        temperature=0.0,
        extra_body={"response_format": city_format()},
    )
    if completion.choices[0].finish_reason == "stop":
        jsonschema.validate(json.loads(completion.choices[0].text), CITY)


def check_weather_call(call) -> None:
    assert call.id.startswith("call_") and call.type == "function"
    assert call.function.name == "get_weather"
    jsonschema.validate(json.loads(call.function.arguments), WEATHER_TOOL["function"]["parameters"])


@pytest.mark.parametrize(
    "tool_choice", ["required", {"type": "function", "function": {"name": "get_weather"}}]
)
def test_forced_tool_calls_parse_and_validate(client, tool_choice):
    response = client.chat.completions.create(
        model=MODEL_NAME,
        messages=ASK_WEATHER,
        tools=[WEATHER_TOOL, TIME_TOOL],
        tool_choice=tool_choice,
        parallel_tool_calls=False,
        temperature=0.0,
        max_tokens=60,
    )
    choice = response.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content is None
    (call,) = choice.message.tool_calls
    if tool_choice != "required" or call.function.name == "get_weather":
        check_weather_call(call)


def test_auto_answers_in_text_or_a_valid_call(client):
    for seed in range(3):
        response = client.chat.completions.create(
            model=MODEL_NAME, messages=ASK_WEATHER, tools=[WEATHER_TOOL], tool_choice="auto",
            temperature=0.8, seed=seed, max_tokens=60,
        )  # fmt: skip
        choice = response.choices[0]
        if choice.message.tool_calls:
            assert choice.finish_reason in ("tool_calls", "length")
            if choice.finish_reason == "tool_calls":
                check_weather_call(choice.message.tool_calls[0])
        else:
            assert choice.message.content is not None


@pytest.mark.parametrize("parallel", [False, True])
def test_streamed_tool_calls_reassemble(client, parallel):
    """In parallel, SmolLM2 greedy repeats its call until max_tokens: every whole call still
    reassembles, and the answer says `length`."""
    stream = client.chat.completions.create(
        model=MODEL_NAME, messages=ASK_WEATHER, tools=[WEATHER_TOOL], tool_choice="required",
        temperature=0.0, max_tokens=60, stream=True, parallel_tool_calls=parallel,
    )  # fmt: skip
    calls: dict[int, dict] = {}
    finish_reasons = []
    for chunk in stream:
        for choice in chunk.choices:
            for delta in choice.delta.tool_calls or []:
                call = calls.setdefault(delta.index, {"id": None, "name": None, "arguments": ""})
                if delta.id is not None:
                    assert call["id"] is None  # the first delta of a call, only
                    call["id"], call["name"] = delta.id, delta.function.name
                call["arguments"] += delta.function.arguments or ""
            if choice.finish_reason:
                finish_reasons.append(choice.finish_reason)
    assert finish_reasons == ["length" if parallel else "tool_calls"]
    whole = calls if not parallel else {i: c for i, c in calls.items() if i < len(calls) - 1}
    assert whole
    for call in whole.values():
        assert call["id"].startswith("call_") and call["name"] == "get_weather"
        jsonschema.validate(json.loads(call["arguments"]), WEATHER_TOOL["function"]["parameters"])


def test_tool_results_come_back_as_tool_messages(client):
    first = client.chat.completions.create(
        model=MODEL_NAME, messages=ASK_WEATHER, tools=[WEATHER_TOOL], tool_choice="required",
        temperature=0.0, max_tokens=60,
    )  # fmt: skip
    call = first.choices[0].message.tool_calls[0]
    messages = [
        *ASK_WEATHER,
        {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
        {"role": "tool", "tool_call_id": call.id, "content": '{"temperature": 21, "sky": "clear"}'},
    ]
    answer = client.chat.completions.create(
        model=MODEL_NAME, messages=messages, tools=[WEATHER_TOOL], temperature=0.0, max_tokens=30
    )
    assert answer.choices[0].finish_reason in ("stop", "length", "tool_calls")


def test_bad_schemas_are_400s_naming_the_field(client):
    with pytest.raises(openai.BadRequestError) as error:
        client.chat.completions.create(
            model=MODEL_NAME, messages=ASK_WEATHER, max_tokens=5,
            response_format={"type": "json_schema",
                             "json_schema": {"name": "x", "schema": {"type": "object", "not": {}}}},
        )  # fmt: skip
    body = error.value.body
    assert body["code"] == "unsupported_schema_keyword"
    assert body["param"] == "response_format.json_schema.schema"


def test_a_grammar_past_the_tenants_cap_is_a_400(embedded_server, unique_name):
    key = create_tenant_with_key(embedded_server.database_url, unique_name, max_grammar_bytes=4000)
    with openai.OpenAI(
        base_url=embedded_server.base_url + "/v1", api_key=key, max_retries=0
    ) as capped:
        with pytest.raises(openai.BadRequestError) as error:
            capped.chat.completions.create(
                model=MODEL_NAME, messages=ASK_WEATHER, response_format=city_format(), max_tokens=5
            )
        assert error.value.body["code"] == "schema_too_large"
        assert error.value.body["param"] == "response_format.json_schema.schema"
        small = capped.chat.completions.create(
            model=MODEL_NAME,
            messages=ASK_WEATHER,
            max_tokens=5,
            response_format={"type": "json_schema",
                             "json_schema": {"name": "yes", "schema": {"enum": ["yes"]}}},
        )  # fmt: skip
        assert small.choices[0].message.content in ("", '"', '"yes', '"yes"')


def test_the_audit_trail_and_metrics_say_constrained(client, embedded_server):
    raw = client.chat.completions.with_raw_response.create(
        model=MODEL_NAME, messages=ASK_WEATHER, response_format=city_format(), max_tokens=5
    )
    request_id = raw.headers["x-request-id"]
    event = wait_for_event(embedded_server, request_id, "grammar_prepared")
    assert event["grammar"] == "json_schema" and event["compile_ms"] >= 0
    assert isinstance(event["cache_hit"], bool)
    with urllib.request.urlopen(embedded_server.base_url + "/metrics") as response:
        text = response.read().decode()
    assert "conveyor:grammar_compile_seconds_count" in text
    assert 'conveyor:constrained_requests_total{cache="' in text


def wait_for_event(server, request_id: str, kind: str, timeout_s: float = 10.0) -> dict:
    path = server.database_url.removeprefix("sqlite:///")
    query = "SELECT data FROM audit_events WHERE request_id = ? AND kind = ?"
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        with sqlite3.connect(path) as connection:
            row = connection.execute(query, (request_id, kind)).fetchone()
        connection.close()
        if row is not None:
            return json.loads(row[0])
        time.sleep(0.1)
    raise AssertionError(f"no {kind} event for {request_id}")
