"""Chat templates come from the model's own files: Qwen's ChatML from its GGUF metadata; a model
without a template (a base model) answers /v1/completions and refuses chat with a 400 that
names the model (a real `conveyor serve`, the official `openai` client)."""

from __future__ import annotations

import json
import shutil

import openai
import pytest
from test_server_support import (
    ServerProcess,
    create_tenant_with_key,
    server_env,
    serving,
    tiny_engine_args,
)

from runtime.models.catalog import pull
from runtime.models.source import open_model

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def base_model_dir(tmp_path_factory, tiny_model_dir):
    """The tiny random Llama with its tokenizer but no chat template."""
    target = tmp_path_factory.mktemp("base-model") / "tiny-base"
    shutil.copytree(tiny_model_dir, target)
    (target / "chat_template.jinja").unlink(missing_ok=True)
    config_path = target / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    config.pop("chat_template", None)
    config_path.write_text(json.dumps(config))
    return target


@pytest.fixture(scope="module")
def base_server(tmp_path_factory, base_model_dir):
    workdir = tmp_path_factory.mktemp("base-server")
    database_url = f"sqlite:///{workdir / 'conveyor.db'}"
    server = ServerProcess(
        workdir, server_env(database_url, None, workdir), tiny_engine_args(base_model_dir),
        database_url,
    )  # fmt: skip
    with serving(server):
        yield server


def test_a_base_model_answers_completions_and_refuses_chat(base_server, base_model_dir):
    key = create_tenant_with_key(base_server.database_url, "base-model-tenant")
    client = openai.OpenAI(base_url=base_server.base_url + "/v1", api_key=key, max_retries=0)
    model = base_model_dir.name
    completion = client.completions.create(model=model, prompt="Once upon", max_tokens=3)
    assert completion.usage.completion_tokens == 3
    with pytest.raises(openai.BadRequestError) as refused:
        client.chat.completions.create(
            model=model, messages=[{"role": "user", "content": "hi"}], max_tokens=3
        )
    assert refused.value.status_code == 400
    assert f"The model '{model}' has no chat template" in refused.value.message
    assert refused.value.code == "model_has_no_chat_template"


@pytest.mark.real_model
def test_qwen_chat_is_its_own_chatml_from_the_gguf():
    tokenizer = open_model(str(pull("qwen2.5-coder-0.5b-instruct"))).load_tokenizer()
    ids = tokenizer.apply_chat_template([{"role": "user", "content": "Reverse a string."}])
    text = tokenizer.decode(ids, skip_special_tokens=False)
    assert text.startswith("<|im_start|>system\nYou are Qwen, created by Alibaba Cloud.")
    assert text.endswith("<|im_start|>user\nReverse a string.<|im_end|>\n<|im_start|>assistant\n")
    assert "tools" in tokenizer.hf_tokenizer.chat_template  # the template renders tool specs


QWEN = "qwen2.5-coder-0.5b-instruct"
WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The current weather in a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}},
            "required": ["city"],
        },
    },
}


@pytest.fixture(scope="module")
def qwen_client(tmp_path_factory):
    pull(QWEN)
    workdir = tmp_path_factory.mktemp("qwen-server")
    database_url = f"sqlite:///{workdir / 'conveyor.db'}"
    args = ["--model", QWEN, "--dtype", "float32", "--kv-cache-memory", "64MiB",
            "--max-num-seqs", "4", "--max-model-len", "2048"]  # fmt: skip
    server = ServerProcess(workdir, server_env(database_url, None, workdir), args, database_url)
    with serving(server):
        key = create_tenant_with_key(database_url, "qwen-tenant")
        yield openai.OpenAI(base_url=server.base_url + "/v1", api_key=key, max_retries=0)


@pytest.mark.real_model
def test_qwen_serves_the_readme_example_and_a_tool_call(qwen_client):
    assert qwen_client.models.list().data[0].id == QWEN
    messages = [{"role": "user", "content": "Say hello in French."}]
    answer = qwen_client.chat.completions.create(model=QWEN, messages=messages, max_tokens=16)
    assert answer.choices[0].message.content.strip()
    asked = [{"role": "user", "content": "What is the weather in Paris right now?"}]
    called = qwen_client.chat.completions.create(  # greedy: sampled, "London" came up once
        model=QWEN, messages=asked, tools=[WEATHER_TOOL], tool_choice="required", max_tokens=48,
        temperature=0,
    )  # fmt: skip
    choice = called.choices[0]
    assert choice.finish_reason == "tool_calls", choice.message
    (call,) = choice.message.tool_calls
    assert call.function.name == "get_weather"
    assert json.loads(call.function.arguments)["city"] == "Paris"
