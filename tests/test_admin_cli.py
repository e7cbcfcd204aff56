"""`conveyor db|tenants|keys` against SQLite and the real PostgreSQL (a fresh schema per test;
PostgreSQL being down fails the test, never skips it)."""

from __future__ import annotations

import asyncio
import json

import pytest
from test_db_support import BACKENDS, temporary_database

from gateway.cli import main
from gateway.db import make_async_engine, make_sessionmaker
from gateway.tenancy.keys import Authenticator, KeyHasher

SECRET = "admin-cli-test-secret"


@pytest.fixture(params=BACKENDS)
def database_url(request, tmp_path, postgres_url):
    with temporary_database(request.param, tmp_path, postgres_url) as url:
        yield url


@pytest.fixture
def sqlite_url(tmp_path):
    return f"sqlite:///{tmp_path / 'conveyor.db'}"


class Cli:
    """Runs `conveyor ...` in-process against one database; returns (exit code, stdout, stderr)."""

    def __init__(self, capsys, database_url: str):
        self.capsys = capsys
        self.database_url = database_url

    def __call__(self, *args: str) -> tuple[int, str, str]:
        self.capsys.readouterr()
        try:
            code = main([*args, "--database-url", self.database_url])
        except SystemExit as exit_:  # argparse refusing a flag
            code = exit_.code
        out, err = self.capsys.readouterr()
        assert "Traceback" not in out + err
        return code, out, err

    def json(self, *args: str):
        code, out, err = self(*args, "--json")
        assert code == 0, err
        return json.loads(out)


async def authenticate(database_url: str, plaintext: str, secret: str = SECRET):
    """What a server with `secret` makes of the key: the tenant's name, or None."""
    engine = make_async_engine(database_url)
    authenticator = Authenticator(make_sessionmaker(engine), KeyHasher(secret))
    try:
        result = await authenticator.authenticate(plaintext)
        await authenticator.close()
    finally:
        await engine.dispose()
    return None if result is None else result.tenant.name


def tenant_flags(**fields) -> list[str]:
    return [f"--{name.replace('_', '-')}={value}" for name, value in fields.items()]


def test_operator_workflow(capsys, database_url):
    cli = Cli(capsys, database_url)
    code, out, err = cli("db", "upgrade")
    assert code == 0, err
    assert "revision 0004" in out

    created = cli.json("tenants", "create", "--name", "acme", "--rpm", "600", "--tpm", "100000",
                       "--default-priority", "2", "--max-priority", "-1", "--weight", "2.5",
                       "--max-concurrency", "4", "--daily-token-quota", "5000000000",
                       "--burst", "20")  # fmt: skip
    assert created == {
        "id": created["id"], "name": "acme", "default_priority": 2, "max_priority": -1,
        "weight": 2.5, "rpm": 600, "burst": 20, "tpm": 100000, "max_concurrency": 4,
        "daily_token_quota": 5_000_000_000, "monthly_token_quota": None,
        "max_grammar_bytes": None, "enabled": True, "model_limits": None,
    }  # fmt: skip
    cli.json("tenants", "create", "--name", "globex", "--disable")
    listed = cli.json("tenants", "list")
    assert [(t["name"], t["enabled"]) for t in listed] == [("acme", True), ("globex", False)]
    code, out, _ = cli("tenants", "list")
    assert out.splitlines()[0].split()[:4] == ["id", "name", "enabled", "default_priority"]
    assert out.splitlines()[0].split()[6:8] == ["rpm", "burst"]  # the limits are columns
    assert out.splitlines()[1].split()[6:8] == ["600", "20"]

    updated = cli.json("tenants", "update", "acme", "--rpm", "none", "--monthly-token-quota", "7")
    assert (updated["rpm"], updated["monthly_token_quota"], updated["tpm"]) == (None, 7, 100000)

    key = cli.json("keys", "create", "--tenant", "acme", "--key-hash-secret", SECRET)
    assert key["key"].startswith(key["prefix"]) and key["tenant"] == "acme"
    assert asyncio.run(authenticate(database_url, key["key"])) == "acme"
    assert asyncio.run(authenticate(database_url, key["key"], secret="other")) is None

    # disabling the tenant stops its keys; enabling brings them back
    cli.json("tenants", "update", "acme", "--disable")
    assert asyncio.run(authenticate(database_url, key["key"])) is None
    cli.json("tenants", "update", "acme", "--enable")
    assert asyncio.run(authenticate(database_url, key["key"])) == "acme"

    code, out, _ = cli("keys", "list", "--tenant", "acme")
    assert key["prefix"] in out and key["key"] not in out
    revoked = cli.json("keys", "revoke", key["prefix"])
    assert revoked["status"] == "revoked" and revoked["id"] == key["id"]
    assert asyncio.run(authenticate(database_url, key["key"])) is None
    assert [k["status"] for k in cli.json("keys", "list", "--tenant", "acme")] == ["revoked"]

    code, out, err = cli("db", "downgrade", "base")
    assert code == 0, err
    assert cli("db", "current")[1].strip() == "base"


def test_keys_create_prints_the_key_once_and_revokes_by_id_or_key(capsys, sqlite_url):
    cli = Cli(capsys, sqlite_url)
    cli("db", "upgrade")
    cli("tenants", "create", "--name", "acme")
    code, out, err = cli("keys", "create", "--tenant", "acme", "--key-hash-secret", SECRET)
    assert code == 0, err
    plaintext = next(word for word in out.split() if word.startswith("cvy_") and len(word) > 20)
    assert "not be shown again" in out
    assert asyncio.run(authenticate(sqlite_url, plaintext)) == "acme"
    second = cli.json("keys", "create", "--tenant", "acme", "--key-hash-secret", SECRET)

    code, out, err = cli("keys", "revoke", plaintext, "--key-hash-secret", SECRET)
    assert code == 0, err
    assert "Revoked" in out and plaintext not in out
    assert asyncio.run(authenticate(sqlite_url, plaintext)) is None
    code, out, _ = cli("keys", "revoke", str(second["id"]))
    assert code == 0 and asyncio.run(authenticate(sqlite_url, second["key"])) is None
    code, out, _ = cli("keys", "revoke", str(second["id"]))
    assert code == 0 and "already revoked" in out


def test_defaults_come_from_the_servers_environment(capsys, sqlite_url, monkeypatch):
    monkeypatch.setenv("CONVEYOR_DATABASE_URL", sqlite_url)
    monkeypatch.setenv("CONVEYOR_KEY_HASH_SECRET", SECRET)
    capsys.readouterr()
    assert main(["db", "upgrade"]) == 0
    assert main(["tenants", "create", "--name", "envco"]) == 0
    assert main(["keys", "create", "--tenant", "envco", "--json"]) == 0
    out, err = capsys.readouterr()
    plaintext = json.loads(out[out.index("{") :])["key"]
    assert "warning" not in err
    assert asyncio.run(authenticate(sqlite_url, plaintext)) == "envco"


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["tenants", "create", "--name", "acme"], "already exists"),
        (["tenants", "create", "--name", "x", "--rpm", "0"], "rpm"),
        (["tenants", "create", "--name", "x", "--weight", "-1"], "weight"),
        (["tenants", "create", "--name", "{x}"], "name"),
        (
            ["tenants", "create", "--name", "x", "--default-priority", "1", "--max-priority", "2"],
            "max_priority",
        ),  # fmt: skip
        (["tenants", "update", "nobody", "--rpm", "5"], "no tenant named 'nobody'"),
        (["tenants", "update", "acme"], "nothing to change"),
        (["tenants", "update", "acme", "--max-priority", "3"], "max_priority"),
        (["keys", "create", "--tenant", "nobody"], "no tenant named 'nobody'"),
        (["keys", "list", "--tenant", "nobody"], "no tenant named 'nobody'"),
        (["keys", "revoke", "999"], "no API key"),
        (["keys", "revoke", "cvy_none"], "no API key"),
        (["db", "downgrade", "nosuchrevision"], "migration failed"),
    ],
)
def test_operator_errors_are_one_line_and_exit_1(capsys, sqlite_url, args, message):
    cli = Cli(capsys, sqlite_url)
    cli("db", "upgrade")
    cli("tenants", "create", "--name", "acme")
    code, out, err = cli(*args)
    assert code == 1
    last_line = err.strip().splitlines()[-1]
    assert last_line.startswith("conveyor: error:") and message in last_line
    assert len(err.strip().splitlines()) <= 2  # the error, maybe a key-secret warning


def test_bad_flags_and_missing_databases_are_refused(capsys, tmp_path):
    cli = Cli(capsys, f"sqlite:///{tmp_path / 'missing.db'}")
    assert cli("tenants", "create", "--name", "x", "--rpm", "lots")[0] == 2
    assert cli("tenants", "update", "x", "--enable", "--disable")[0] == 2
    code, _, err = cli("tenants", "list")
    assert code == 1 and "conveyor db upgrade" in err
    assert not (tmp_path / "missing.db").exists()
    code, _, err = Cli(capsys, "mysql://root:hunter2@db/x")("tenants", "list")
    assert code == 1 and "unsupported" in err and "hunter2" not in err


def test_unmigrated_postgres_schema_gets_a_hint(capsys, tmp_path, postgres_url):
    with temporary_database("postgresql", tmp_path, postgres_url) as url:
        code, _, err = Cli(capsys, url)("tenants", "list")
    assert code == 1 and "conveyor db upgrade" in err
