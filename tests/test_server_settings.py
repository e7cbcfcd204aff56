"""`conveyor serve` settings (flags, `CONVEYOR_*` variables, defaults) and the error layer, in
process and without a model."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest
from aiohttp import web
from aiohttp.test_utils import TestClient, TestServer
from pydantic import BaseModel, ValidationError

from gateway.cli import build_parser
from gateway.errors import (
    add_request_id_header,
    error_middleware,
    from_validation_error,
    request_id_middleware,
)
from gateway.serve import settings_from_args
from gateway.settings import ServeSettings
from runtime.config import EngineConfig

ROOT = Path(__file__).resolve().parents[1]


def serve_settings(*argv: str) -> ServeSettings:
    return settings_from_args(build_parser().parse_args(["serve", *argv]))


def serve_flag_dests() -> set[str]:
    parser = build_parser()
    subparsers = next(a for a in parser._actions if a.dest == "command")
    return {action.dest for action in subparsers.choices["serve"]._actions}


def every_parser(parser):
    yield parser
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for child in action.choices.values():
                yield from every_parser(child)


def test_every_commands_help_renders():
    """argparse formats help with %: a description's "%" (a figure quoted in a flag's help)
    broke `conveyor serve --help` with a TypeError."""
    for parser in every_parser(build_parser()):
        assert parser.format_help().startswith("usage: ")


def test_every_setting_has_a_flag():
    assert set(ServeSettings.model_fields) <= serve_flag_dests()


def test_engine_settings_are_the_engine_config_fields_not_copies():
    for name, info in EngineConfig.model_fields.items():
        assert repr(ServeSettings.model_fields[name]) == repr(info), name
    assert ServeSettings().engine_config() == EngineConfig()


def test_engine_flags_come_from_the_model_with_its_bounds_and_choices(tmp_path):
    parser = build_parser("generate")
    args = parser.parse_args(["generate", "--input", "a", "--output", "b"])
    assert EngineConfig.from_args(args) == EngineConfig()
    with pytest.raises(SystemExit):
        parser.parse_args(["generate", "--input", "a", "--output", "b", "--dtype", "int8"])
    args = parser.parse_args(["generate", "--input", "a", "--output", "b", "--max-num-seqs", "0"])
    with pytest.raises(ValidationError):
        EngineConfig.from_args(args)
    args = parser.parse_args(
        ["generate", "--input", "a", "--output", "b", "--no-prefix-caching", "--seed", "7"]
    )
    config = EngineConfig.from_args(args)
    assert (config.enable_prefix_caching, config.seed) == (False, 7)


def alternatives(entry: dict) -> list[dict]:
    """The non-null schemas an entry allows (through nested oneOf/anyOf)."""
    nested = entry.get("oneOf") or entry.get("anyOf")
    if nested is None:
        return [] if entry.get("type") == "null" else [entry]
    return [leaf for option in nested for leaf in alternatives(option)]


def chart_setting_schemas() -> dict[str, list[dict]]:
    """The chart's `config` section: setting name -> the non-null schemas it accepts."""
    schema = json.loads((ROOT / "helm/conveyor/values.schema.json").read_text())
    return {
        "".join("_" + c.lower() if c.isupper() else c for c in key): alternatives(entry)
        for key, entry in schema["properties"]["config"]["properties"].items()
    }


def test_the_charts_settings_schema_agrees_with_the_settings_model():
    """Type, choices, bounds and pattern of each setting the chart takes are the model's."""
    properties = ServeSettings.model_json_schema()["properties"]
    for name, chart_options in chart_setting_schemas().items():
        (model,) = alternatives(properties[name])
        typed = [option for option in chart_options if option["type"] == model["type"]]
        assert len(typed) == 1, name
        chart = typed[0]
        if "enum" in model:
            assert {str(v).lower() for v in chart["enum"]} == set(model["enum"]), name
        for bound in ("minimum", "maximum", "exclusiveMinimum", "pattern"):
            assert chart.get(bound) == model.get(bound), (name, bound)


def test_flag_beats_environment_beats_default(monkeypatch):
    assert serve_settings().port == 8000
    monkeypatch.setenv("CONVEYOR_PORT", "9001")
    monkeypatch.setenv("CONVEYOR_MAX_NUM_SEQS", "7")
    monkeypatch.setenv("CONVEYOR_ENABLE_PREFIX_CACHING", "false")
    settings = serve_settings("--max-num-seqs", "3")
    assert settings.port == 9001
    assert settings.max_num_seqs == 3
    assert settings.enable_prefix_caching is False
    assert serve_settings("--no-prefix-caching").enable_prefix_caching is False


def test_a_negatable_switch_takes_both_spellings():
    """--draft-prompt-lookup became the default: --no-draft-prompt-lookup turns it off, and
    the old switch still parses (scripts that pass it keep working)."""
    assert serve_settings().draft_prompt_lookup is True
    assert serve_settings("--no-draft-prompt-lookup").draft_prompt_lookup is False
    assert serve_settings("--draft-prompt-lookup").draft_prompt_lookup is True


@pytest.mark.parametrize(
    "variable, value, field, expected",
    [
        ("CONVEYOR_HOST", "0.0.0.0", "host", "0.0.0.0"),
        ("CONVEYOR_DATABASE_URL", "postgresql://u@h/db", "database_url", "postgresql://u@h/db"),
        ("CONVEYOR_REDIS_URL", "redis://h:6379/1", "redis_url", "redis://h:6379/1"),
        ("CONVEYOR_REDIS_URL", "", "redis_url", None),
        ("CONVEYOR_MAX_BODY_BYTES", "4096", "max_body_bytes", 4096),
        ("CONVEYOR_RATE_LIMIT_ON_ERROR", "closed", "rate_limit_on_error", "closed"),
        ("CONVEYOR_KEY_HASH_SECRET", "s3cret", "key_hash_secret", "s3cret"),
        ("CONVEYOR_ADMIN_TOKENS", "a, b,,c", "admin_tokens", ["a", "b", "c"]),
        ("CONVEYOR_DRAIN_TIMEOUT", "2.5", "drain_timeout", 2.5),
        ("CONVEYOR_MODEL", "/models/x.gguf", "model", "/models/x.gguf"),
        ("CONVEYOR_KV_CACHE_MEMORY", "1GiB", "kv_cache_memory", "1GiB"),
    ],
)
def test_environment_variables(monkeypatch, variable, value, field, expected):
    monkeypatch.setenv(variable, value)
    assert getattr(serve_settings(), field) == expected


def test_bad_settings_are_refused(monkeypatch):
    monkeypatch.setenv("CONVEYOR_RATE_LIMIT_ON_ERROR", "sometimes")
    with pytest.raises(ValidationError):
        ServeSettings()


class Body(BaseModel):
    prompt: str | list[int]
    n: int = 1


@pytest.mark.parametrize(
    "raw, param",
    [
        ('{"prompt": 3}', "prompt"),
        ('{"prompt": "x", "n": "2"}', "n"),
        ('{"prompt": [1, "a"]}', "prompt.1"),
        ("{", None),
    ],
)
def test_validation_errors_name_the_field(raw, param):
    with pytest.raises(ValidationError) as caught:
        Body.model_validate_json(raw, strict=True)
    error = from_validation_error(caught.value)
    assert (error.status, error.param) == (400, param)


async def test_unexpected_errors_become_a_generic_500_without_details(caplog):
    async def explode(request):
        raise RuntimeError("secret internals")

    app = web.Application(middlewares=[request_id_middleware(), error_middleware()])
    app.on_response_prepare.append(add_request_id_header)
    app.router.add_get("/explode", explode)
    async with TestClient(TestServer(app)) as client:
        response = await client.get("/explode")
        body = await response.json()
        missing = await client.get("/nowhere")
        missing_body = await missing.json()
    assert response.status == 500
    assert body["error"]["type"] == "server_error"
    assert "secret" not in body["error"]["message"]
    assert response.headers["x-request-id"]
    assert missing.status == 404
    assert missing_body["error"]["code"] == "not_found"
    assert "secret internals" in caplog.text  # logged for the operator, not sent


async def test_a_body_that_never_arrives_is_a_408_and_integral_numbers_are_integers(monkeypatch):
    import asyncio

    from gateway import jsonbody

    monkeypatch.setattr(jsonbody, "BODY_READ_TIMEOUT_S", 0.3)

    async def echo(request):
        body = await jsonbody.read_model(request, Body)
        return web.json_response(body.model_dump())

    app = web.Application(middlewares=[request_id_middleware(), error_middleware()])
    app.router.add_post("/echo", echo)
    async with TestServer(app) as server:
        reader, writer = await asyncio.open_connection(server.host, server.port)
        writer.write(b"POST /echo HTTP/1.1\r\nHost: x\r\nContent-Length: 50\r\n\r\n{")
        await writer.drain()
        answer = await asyncio.wait_for(reader.read(4096), 5)  # no hang: the server answers
        writer.close()
        await writer.wait_closed()
        async with TestClient(server) as client:
            integral = await client.post("/echo", data=b'{"prompt": "x", "n": 2.0}')
            integral_body = await integral.json()
    assert answer.startswith(b"HTTP/1.1 408") and b'"request_timeout"' in answer
    assert integral.status == 200 and integral_body["n"] == 2


# ---- --served-model-name ------------------------------------------------------------------------
def test_served_model_names_come_from_the_flag_or_the_environment(monkeypatch):
    assert serve_settings().served_model_name is None
    flagged = serve_settings("--served-model-name", "smol", "gpt-4o-mini")
    assert flagged.served_model_name == ["smol", "gpt-4o-mini"]
    assert flagged.engine_config().served_model_name == ["smol", "gpt-4o-mini"]
    monkeypatch.setenv("CONVEYOR_SERVED_MODEL_NAME", "a, b c")
    assert serve_settings().served_model_name == ["a", "b", "c"]
    monkeypatch.setenv("CONVEYOR_SERVED_MODEL_NAME", "")
    assert serve_settings().served_model_name is None


def test_the_default_served_name_is_derived_from_the_model():
    from runtime.models.loader import served_model_names

    assert served_model_names("/models/my-llama", None) == ("my-llama",)
    assert served_model_names("/x/SmolLM2.Q4.gguf", []) == ("SmolLM2.Q4",)
    assert served_model_names("/models/my-llama", ["a", "b"]) == ("a", "b")


# ---- one declaration of the sampling ranges -----------------------------------------------------
@pytest.mark.parametrize("name", ["temperature", "top_p", "n", "logprobs", "presence_penalty"])
def test_the_api_and_the_engine_read_the_same_sampling_bounds(name):
    from gateway.openai.schemas import CompletionRequest
    from scheduler.request import SAMPLING_BOUNDS, SamplingParams, SamplingParamsError

    bound = SAMPLING_BOUNDS[name]
    schema = CompletionRequest.model_json_schema()["properties"][name]
    numbers = [s for s in schema.get("anyOf", [schema]) if s.get("type") in ("number", "integer")]
    (number,) = numbers
    assert number.get("maximum", number.get("exclusiveMaximum")) == bound.high
    just_above = bound.high + (1 if isinstance(bound.high, int) else 0.01)
    with pytest.raises(SamplingParamsError) as caught:
        SamplingParams(**{name: just_above}).validate()
    assert caught.value.param == name
