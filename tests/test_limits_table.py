"""`gateway.tenancy.limits` is the one declaration of a tenant's limits: everything that names a
limit kind is built from it, and every kind with a refusal is enforced by the Lua script.

A new row in the table makes these tests check the new kind everywhere; the only other places
to change are the Lua script, the SQL model and a migration."""

from __future__ import annotations

import argparse
import re

import pytest
import sqlalchemy as sa

from gateway.admin.tenants import TenantPatch, TenantUsage
from gateway.audit.explain import REFUSALS as EXPLAINED
from gateway.cli import build_parser
from gateway.models import Tenant
from gateway.redis_client import make_redis
from gateway.tenancy.admission import refusal_error, tenant_limits
from gateway.tenancy.limit_scripts import ADMIT_LUA
from gateway.tenancy.limits import LIMIT_FIELDS, REFUSALS, SCRIPT_LIMIT_FIELDS
from gateway.tenancy.ratelimit import Admission, RateLimiter, TenantLimits, limit_args
from gateway.tenancy.tenants import TenantCreate, TenantOut, TenantUpdate

WITH_REFUSAL = [limit for limit in LIMIT_FIELDS if limit.refusal is not None]


def schema_of(model, name: str) -> dict:
    prop = model.model_json_schema()["properties"][name]
    return next(option for option in prop.get("anyOf", [prop]) if option.get("type") == "integer")


@pytest.mark.parametrize("limit", LIMIT_FIELDS, ids=lambda limit: limit.name)
def test_every_model_has_the_field_with_the_tables_bounds(limit):
    column = Tenant.__table__.columns[limit.name]
    assert column.nullable == limit.nullable
    assert isinstance(column.type, sa.BigInteger if limit.le > 2**31 - 1 else sa.Integer)
    for model in (TenantCreate, TenantPatch):
        bounds = schema_of(model, limit.name)
        assert (bounds["minimum"], bounds["maximum"]) == (limit.ge, limit.le)
    assert TenantCreate.model_fields[limit.name].default == limit.default
    for model in (TenantUpdate, TenantOut, TenantUsage):
        assert limit.name in model.model_fields
    assert limit.name in TenantLimits.__dataclass_fields__


@pytest.mark.parametrize("command", ["create", "update"])
def test_every_limit_is_a_cli_flag_with_the_tables_help(command):
    tenants = subcommand(build_parser(), "tenants")
    parser = subcommand(tenants, command)
    flags = {
        action.option_strings[0]: action for action in parser._actions if action.option_strings
    }
    for limit in LIMIT_FIELDS:
        assert flags[limit.flag].help == limit.help
        assert (flags[limit.flag].metavar == "N|none") == limit.nullable


def subcommand(parser: argparse.ArgumentParser, name: str) -> argparse.ArgumentParser:
    action = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return action.choices[name]


def test_the_script_takes_the_limits_in_the_tables_order():
    values = {limit.name: index + 1 for index, limit in enumerate(LIMIT_FIELDS)}
    scripted = [values[limit.name] for limit in SCRIPT_LIMIT_FIELDS]
    assert limit_args(TenantLimits(tenant="t", **values)) == scripted
    unset = limit_args(TenantLimits(tenant="t"))
    assert unset == [-1 if limit.nullable else limit.default for limit in SCRIPT_LIMIT_FIELDS]
    # what the gateway checks elsewhere comes after every scripted limit: ARGV keeps its places
    assert LIMIT_FIELDS[: len(SCRIPT_LIMIT_FIELDS)] == SCRIPT_LIMIT_FIELDS


def test_every_refusal_the_script_gives_is_in_the_table():
    given = set(re.findall(r"refuse\('([a-z_]+)'", ADMIT_LUA))
    assert given == {limit.refusal.reason for limit in WITH_REFUSAL}
    assert set(REFUSALS) == given | {"unavailable"}


@pytest.mark.parametrize("reason", sorted(REFUSALS))
def test_a_refusal_reads_its_words_from_the_table(reason):
    refusal = REFUSALS[reason]
    error = refusal_error(Admission(allowed=False, reason=reason, retry_after=2))
    assert (error.status, error.type, error.code) == (
        refusal.http_status,
        refusal.error_type,
        refusal.code,
    )
    assert str(error.message).startswith(refusal.message)
    assert EXPLAINED[reason] == refusal.phrase


class Row:
    """A tenant as the database gives it."""

    def __init__(self, **fields):
        self.__dict__.update(fields)


@pytest.mark.parametrize("limit", WITH_REFUSAL, ids=lambda limit: limit.name)
async def test_each_kind_refuses_at_its_lowest_bound(limit, unique_name):
    tenant = Row(name=f"{unique_name}-{limit.name}", **{f.name: f.default for f in LIMIT_FIELDS})
    setattr(tenant, limit.name, limit.ge)
    limiter = RateLimiter(make_redis(None))
    limits = tenant_limits(tenant)
    admissions = [await limiter.admit(limits, f"r{i}", 1, 1) for i in range(3)]
    refused = [a for a in admissions if not a.allowed]
    assert refused and {a.reason for a in refused} == {limit.refusal.reason}
    await limiter.redis.aclose()
