"""Helpers for the end-to-end server tests (no tests here): a real `conveyor serve` process on a
free localhost port, tenants and keys written straight into its database, and the admin view
of its KV cache."""

from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
MODEL_NAME = "SmolLM2-135M-Instruct"
ADMIN_TOKEN = "test-admin-token"
KEY_HASH_SECRET = "test-key-hash-secret"
STARTUP_TIMEOUT_S = 240.0
# Small enough to start fast, big enough for every test: 128 MiB holds ~360 blocks of 16 tokens.
ENGINE_ARGS = [
    "--kv-cache-memory", "128MiB",
    "--swap-space", "0.05",
    "--max-num-seqs", "8",
    "--max-model-len", "1024",
]  # fmt: skip
DEMO_KEY_PATTERN = re.compile(r"API key: (cvy_\S+)")


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@dataclass
class ServerProcess:
    """`python -m gateway.cli serve` with the given environment; output goes to a log file."""

    workdir: Path
    env: dict[str, str]
    args: list[str] = field(default_factory=list)
    database_url: str = ""
    port: int = field(default_factory=free_port)
    process: subprocess.Popen | None = None

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def log_path(self) -> Path:
        return self.workdir / "server.log"

    def start(self) -> ServerProcess:
        command = [sys.executable, "-m", "gateway.cli", "serve", "--port", str(self.port)]
        env = {**os.environ, "PYTHONPATH": str(REPO_ROOT), **self.env}
        with self.log_path.open("wb") as log:
            self.process = subprocess.Popen(
                command + self.args, cwd=self.workdir, env=env, stdout=log, stderr=subprocess.STDOUT
            )
        return self

    def log_text(self) -> str:
        return self.log_path.read_text(errors="replace")

    def wait_ready(self, timeout_s: float = STARTUP_TIMEOUT_S) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"server exited early:\n{self.log_text()[-4000:]}")
            if self.get_status("/readyz") == 200:
                return
            time.sleep(0.3)
        raise TimeoutError(f"server not ready in {timeout_s} s:\n{self.log_text()[-4000:]}")

    def get_status(self, path: str) -> int | None:
        try:
            with urllib.request.urlopen(self.base_url + path, timeout=2.0) as response:
                return response.status
        except urllib.error.HTTPError as error:
            error.close()
            return error.code
        except OSError:
            return None

    def stop(self) -> int:
        if self.process is None or self.process.poll() is not None:
            return self.process.returncode if self.process else 0
        self.process.send_signal(signal.SIGTERM)
        try:
            return self.process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.process.kill()
            return self.process.wait()

    def demo_key(self) -> str | None:
        match = DEMO_KEY_PATTERN.search(self.log_text())
        return match.group(1) if match else None

    def engine_state(self) -> dict:
        headers = {"Authorization": f"Bearer {ADMIN_TOKEN}"}
        request = urllib.request.Request(self.base_url + "/admin/engine", headers=headers)
        with urllib.request.urlopen(request, timeout=5.0) as response:
            return json.loads(response.read())

    def wait_for_idle_kv(self, timeout_s: float = 15.0) -> dict:
        """Poll until no sequence holds a KV block; returns the last engine state."""
        deadline = time.monotonic() + timeout_s
        state = self.engine_state()
        while time.monotonic() < deadline:
            state = self.engine_state()
            if state["num_used_gpu_blocks"] == 0 and state["num_running"] == 0:
                return state
            time.sleep(0.1)
        return state


@contextmanager
def serving(*servers: ServerProcess) -> Iterator[None]:
    """Start the servers, wait until all are ready; on the way out stop them all and insist that
    each exited cleanly (a crash on shutdown fails the fixture, with the server's log)."""
    for server in servers:
        if server.process is None:
            server.start()
    try:
        for server in servers:
            server.wait_ready()
        yield
    finally:
        exit_codes = [server.stop() for server in servers]
    for server, exit_code in zip(servers, exit_codes):
        assert exit_code == 0, server.log_text()[-4000:]


def server_env(database_url: str, redis_url: str | None, workdir: Path) -> dict[str, str]:
    env = {
        "CONVEYOR_DATABASE_URL": database_url,
        "CONVEYOR_KEY_HASH_SECRET": KEY_HASH_SECRET,
        "CONVEYOR_ADMIN_TOKENS": ADMIN_TOKEN,
        "CONVEYOR_MAX_WAITING_REQUESTS": "8",
        "CONVEYOR_AUDIT_SPOOL_PATH": str(workdir / "audit.spool"),
    }
    if redis_url is not None:
        env["CONVEYOR_REDIS_URL"] = redis_url
    return env


def create_tenant_with_key(database_url: str, name: str, **fields) -> str:
    """A tenant and one key in the server's database (as an operator would); the key's text."""
    return asyncio.run(_create_tenant_with_key(database_url, name, fields))


async def _create_tenant_with_key(database_url: str, name: str, fields: dict) -> str:
    from gateway.db import make_async_engine, make_sessionmaker
    from gateway.tenancy.keys import KeyHasher, create_key
    from gateway.tenancy.tenants import TenantCreate, create_tenant

    engine = make_async_engine(database_url)
    try:
        async with make_sessionmaker(engine).begin() as session:
            tenant = await create_tenant(session, TenantCreate(name=name, **fields))
            _, plaintext = await create_key(session, tenant.id, KeyHasher(KEY_HASH_SECRET))
    finally:
        await engine.dispose()
    return plaintext


def real_service_urls() -> tuple[str, str]:
    """(Redis URL, PostgreSQL URL) as `conftest.py` reads them; the same environment variables."""
    redis_url = os.environ.get("CONVEYOR_TEST_REDIS_URL", "redis://127.0.0.1:6379/0")
    postgres_url = os.environ.get(
        "CONVEYOR_TEST_POSTGRES_URL", "postgresql://postgres@127.0.0.1:5432/test"
    )
    return redis_url, postgres_url


def get_json(url: str, timeout_s: float = 5.0) -> tuple[int, dict]:
    try:
        with urllib.request.urlopen(url, timeout=timeout_s) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as error:
        with error:
            return error.code, json.loads(error.read())


# ---- tiny-model servers and the audit log, for the shutdown and replica tests -----------------
def tiny_engine_args(model_dir: Path) -> list[str]:
    """`conveyor serve` engine flags for the random 2-layer Llama of `tiny_model_dir`; on the CPU
    everywhere, so that streams last long enough to be interrupted (~10 ms a step)."""
    return ["--model", str(model_dir), "--device", "cpu", "--dtype", "float32",
            "--kv-cache-memory", "32MiB",
            "--swap-space", "0.01", "--max-num-seqs", "8", "--max-model-len", "1024"]  # fmt: skip


def audit_records_of(database_url: str, tenant_name: str) -> list[dict]:
    """Every audit record of one tenant, read straight from the database."""
    from sqlalchemy import select

    from gateway.db import make_sync_engine
    from gateway.models import AuditRecord, Tenant

    engine = make_sync_engine(database_url)
    try:
        with engine.connect() as connection:
            rows = connection.execute(
                select(AuditRecord.__table__)
                .join(Tenant, Tenant.id == AuditRecord.tenant_id)
                .where(Tenant.name == tenant_name)
            )
            return [dict(row._mapping) for row in rows]
    finally:
        engine.dispose()
