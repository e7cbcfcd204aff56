"""The table of a tenant's limits: one row per field, read by everything else.

Each row says what the field is called (the SQL column, the JSON field, the `--flag`), its
bounds, its CLI help, and, for a limit that can refuse a request, the refusal: its reason (as
the Lua script returns it and the audit log stores it), the OpenAI error type and code, the
message the client reads and the phrase an explanation uses. The pydantic tenant models, the
admin API and CLI, the arguments of the rate-limit script and the explanations are all built
from `LIMIT_FIELDS` and `REFUSALS`.

Adding a limit kind: a row here, its check in `limit_scripts.ADMIT_LUA` (which receives the
limits as ARGV in the order of `SCRIPT_LIMIT_FIELDS`) unless the gateway checks it elsewhere
(`max_grammar_bytes`: when the grammar is compiled), a column in `gateway.models.Tenant` and an
Alembic migration.
"""

from __future__ import annotations

from dataclasses import dataclass

INT32_MAX = 2**31 - 1


INT64_MAX = 2**63 - 1


@dataclass(frozen=True)
class Refusal:
    """Why a request was refused, in each of the words the layers above need."""

    reason: str  # Lua reply, audit `refusal_reason`
    error_type: str  # OpenAI error `type`
    code: str  # OpenAI error `code`
    message: str  # the start of the client's error message
    phrase: str  # "refused because of <phrase>" in an explanation
    http_status: int = 429


@dataclass(frozen=True)
class LimitField:
    """A tenant field that limits it. `nullable`: None (SQL NULL, `--flag none`) is unlimited."""

    name: str
    help: str
    ge: int
    le: int
    default: int | None = None
    nullable: bool = True
    refusal: Refusal | None = None
    checked_in_redis: bool = True  # an argument of the rate-limit scripts

    @property
    def flag(self) -> str:
        return "--" + self.name.replace("_", "-")


RATE_LIMIT = "rate_limit_exceeded"


QUOTA = "insufficient_quota"


LIMIT_FIELDS: tuple[LimitField, ...] = (
    LimitField(
        "rpm",
        "requests per minute: at most rpm + burst admitted in any 60 s",
        ge=1,
        le=INT32_MAX,
        refusal=Refusal(
            "rate_limit_requests",
            "requests",
            RATE_LIMIT,
            "Rate limit reached for requests per minute.",
            "the tenant's requests-per-minute limit",
        ),
    ),  # fmt: skip
    LimitField(
        "burst",
        "extra requests on top of rpm in any 60 s (default 0: none)",
        ge=0,
        le=INT32_MAX,
        default=0,
        nullable=False,
    ),
    LimitField(
        "tpm",
        "tokens per minute (prompt + max_tokens reserved, the unused part refunded)",
        ge=1,
        le=INT64_MAX,
        refusal=Refusal(
            "rate_limit_tokens",
            "tokens",
            RATE_LIMIT,
            "Rate limit reached for tokens per minute.",
            "the tenant's tokens-per-minute limit",
        ),
    ),  # fmt: skip
    LimitField(
        "max_concurrency",
        "requests running at once",
        ge=1,
        le=INT32_MAX,
        refusal=Refusal(
            "concurrency",
            "requests",
            RATE_LIMIT,
            "Too many concurrent requests.",
            "the tenant's concurrency limit",
        ),
    ),  # fmt: skip
    LimitField(
        "daily_token_quota",
        "tokens per UTC day",
        ge=1,
        le=INT64_MAX,
        refusal=Refusal(
            "daily_quota",
            "insufficient_quota",
            QUOTA,
            "Daily token quota exceeded.",
            "the tenant's daily token quota",
        ),
    ),  # fmt: skip
    LimitField(
        "monthly_token_quota",
        "tokens per UTC month",
        ge=1,
        le=INT64_MAX,
        refusal=Refusal(
            "monthly_quota",
            "insufficient_quota",
            QUOTA,
            "Monthly token quota exceeded.",
            "the tenant's monthly token quota",
        ),
    ),  # fmt: skip
    LimitField(
        "max_grammar_bytes",
        "memory of one compiled grammar (response_format json_schema, tools): a larger one is "
        "a 400 schema_too_large",
        ge=1,
        le=INT64_MAX,
        checked_in_redis=False,  # checked when the grammar is compiled
    ),
)


UNAVAILABLE = Refusal(
    "unavailable", "server_error", "service_unavailable",
    "Rate limiter unavailable.",
    "the rate limiter being unreachable (fail-closed)",
    http_status=503,
)  # fmt: skip


REFUSALS: dict[str, Refusal] = {
    limit.refusal.reason: limit.refusal for limit in LIMIT_FIELDS if limit.refusal is not None
} | {UNAVAILABLE.reason: UNAVAILABLE}


SCRIPT_LIMIT_FIELDS: tuple[LimitField, ...] = tuple(
    limit for limit in LIMIT_FIELDS if limit.checked_in_redis
)


LIMIT_NAMES: tuple[str, ...] = tuple(limit.name for limit in LIMIT_FIELDS)


def limit_field(name: str) -> LimitField:
    return next(limit for limit in LIMIT_FIELDS if limit.name == name)
