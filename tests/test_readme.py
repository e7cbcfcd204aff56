"""README.md's walk-through ("From `make serve` to an answered request") runs as written.

Its ```bash blocks are run in order, as one script, against a started `conveyor serve` (the tiny
random Llama, SQLite and in-process limits: the embedded defaults `make serve` uses). Only
what differs between `make serve` and this test is replaced: the `.venv` paths, the port and
the model's name.
"""

from __future__ import annotations

import re
import subprocess
import sys

import pytest
from test_server_support import (
    KEY_HASH_SECRET,
    REPO_ROOT,
    ServerProcess,
    server_env,
    serving,
    tiny_engine_args,
)

pytestmark = [pytest.mark.slow]

SECTION = "## From `make serve` to an answered request"
BASH_BLOCK = re.compile(r"^```bash\n(.*?)^```$", re.DOTALL | re.MULTILINE)


def walk_through_blocks() -> list[str]:
    readme = (REPO_ROOT / "README.md").read_text()
    start = readme.index(SECTION)
    end = readme.index("\n## ", start + len(SECTION))
    return BASH_BLOCK.findall(readme[start:end])


def as_run_here(block: str, base_url: str, model_name: str) -> str:
    commands = {"conveyor": f"{sys.executable} -m gateway.cli", "python": sys.executable}
    block = re.sub(r"\.venv/bin/(conveyor|python)\b", lambda m: commands[m.group(1)], block)
    block = block.replace("http://127.0.0.1:8000", base_url)
    return block.replace("SmolLM2-135M-Instruct", model_name)


@pytest.fixture(scope="module")
def server(tmp_path_factory, tiny_model_dir):
    workdir = tmp_path_factory.mktemp("readme")
    database_url = f"sqlite:///{workdir / 'conveyor.db'}"
    env = server_env(database_url, None, workdir) | {"CONVEYOR_CREATE_DEMO_TENANT": "false"}
    process = ServerProcess(workdir, env, tiny_engine_args(tiny_model_dir), database_url)
    with serving(process):
        yield process


def test_the_walk_through_has_the_steps_the_issue_names():
    script = "\n".join(walk_through_blocks())
    for step in ("tenants create", "keys create", "curl", "from openai import OpenAI",
                 "stream=True", "x-ratelimit", "/v1/requests/$ID"):  # fmt: skip
        assert step in script, step


def test_the_walk_through_runs(server, tiny_model_dir):
    blocks = [as_run_here(b, server.base_url, tiny_model_dir.name) for b in walk_through_blocks()]
    script = "set -euo pipefail\n" + "\n".join(blocks)
    env = {
        "PATH": "/usr/local/bin:/usr/bin:/bin",
        "PYTHONPATH": str(REPO_ROOT),
        "CONVEYOR_DATABASE_URL": server.database_url,
        "CONVEYOR_KEY_HASH_SECRET": KEY_HASH_SECRET,
    }
    done = subprocess.run(
        ["bash", "-c", script], cwd=server.workdir, env=env, capture_output=True, text=True,
        timeout=180,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr
    out = done.stdout
    assert "Created tenant 'acme'" in out
    assert '"object":"list"' in out.replace(" ", "")  # /v1/models
    assert re.search(r'"id": "chatcmpl-', out)
    headers = dict(re.findall(r"^(x-ratelimit-[a-z-]+): (\S+)", out, re.MULTILINE))
    assert headers == {
        "x-ratelimit-limit-requests": "60",
        "x-ratelimit-remaining-requests": "58",  # /v1/models, then the chat completion
        "x-ratelimit-reset-requests": "0s",
        "x-ratelimit-limit-tokens": "20000",
        "x-ratelimit-remaining-tokens": headers["x-ratelimit-remaining-tokens"],
        "x-ratelimit-reset-tokens": "0s",
    }
    prompt_tokens = int(re.search(r'"prompt_tokens": (\d+)', out).group(1))
    reserved = prompt_tokens + 16  # prompt + max_tokens, held while it runs
    assert headers["x-ratelimit-remaining-tokens"] == str(20000 - reserved)
    assert "requests left: 56" in out  # models.list() and the completion
    lines = out.splitlines()
    assert any(line.startswith("The request at priority 0 finished (length)") for line in lines)
    assert lines[-1].startswith("In total,")  # the explanation ends the walk-through
    assert '"code":"endpoint_not_allowed"' in out.replace(" ", "")  # the scoped key
    assert re.search(r"^Rotated API key \d+ to \d+", out, re.MULTILINE)
    assert re.search(r"^\d+ +acme +cvy_\S+ +ci +rotated ", out, re.MULTILINE)
