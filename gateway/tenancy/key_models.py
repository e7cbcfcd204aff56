"""What a key is made of besides its hash: a name, an expiry, its rotation, its scopes (models,
endpoints) and its own limits; the bodies that create, change and rotate it; its state.

States (`key_state`): `revoked`; `rotated` (replaced by a new key; it works until
`grace_ends_at`); `expired`; `expiring` (within `EXPIRING_WITHIN`); `active`.
"""

from __future__ import annotations

import re
from datetime import datetime, timedelta, timezone
from typing import Annotated, Any, Literal, get_args

from pydantic import (
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    computed_field,
    create_model,
)

from gateway.models import utcnow
from gateway.tenancy.limits import SCRIPT_LIMIT_FIELDS

EXPIRING_WITHIN = timedelta(days=7)


# "30d", "12h", "90m", "45s", "2w"; at most 99999 days or 9999 weeks (a date far past that
# is beyond what a datetime holds)
DURATION_PATTERN = r"^([1-9][0-9]{0,4}(s|m|h|d)|[1-9][0-9]{0,3}w)$"


DURATION_UNITS_S = {"s": 1, "m": 60, "h": 3600, "d": 86_400, "w": 604_800}


MAX_GRACE_S = 30 * 86_400


MODEL_PATTERN = r"^[A-Za-z0-9_.:/*?\[\]-]{1,256}$"  # a served name or a glob over them


def parse_duration(text: str) -> timedelta:
    """ "30d" -> 30 days; units s, m, h, d, w."""
    if not re.fullmatch(DURATION_PATTERN, text):
        raise ValueError(f"a duration is a number and a unit (s, m, h, d, w), not {text!r}")
    return timedelta(seconds=int(text[:-1]) * DURATION_UNITS_S[text[-1]])


def iso_date_time(value: Any) -> Any:
    """An ISO 8601 text (with its offset; none: UTC), never a number of seconds."""
    if isinstance(value, datetime):
        return value
    if isinstance(value, str) and re.match(r"^[0-9]{4}-", value.strip()):
        try:
            return as_utc(datetime.fromisoformat(value.strip()))
        except ValueError:
            pass
    raise ValueError("Input should be an ISO 8601 date-time, e.g. 2026-12-31T00:00:00Z")


IsoDateTime = Annotated[datetime, BeforeValidator(iso_date_time)]


def as_utc(value: datetime | None) -> datetime | None:
    if value is None or value.tzinfo is not None:
        return value
    return value.replace(tzinfo=timezone.utc)


# ---- limits --------------------------------------------------------------------------------
def optional_limit_fields() -> dict[str, Any]:
    """Every limit the rate-limit script checks, each optional (absent: no limit of its own)."""
    return {
        limit.name: (int | None, Field(None, ge=limit.ge, le=limit.le, description=limit.help))
        for limit in SCRIPT_LIMIT_FIELDS
    }


ScopedLimits = create_model(
    "ScopedLimits",
    __config__=ConfigDict(extra="forbid", strict=True),
    **optional_limit_fields(),
)
ScopedLimits.__doc__ = (
    "Limits of a key or of one model of a tenant, nested under the tenant's: a request is "
    "admitted only if every one of them admits it. Absent or null: no limit of its own."
)


def stored_limits(limits: BaseModel | None) -> dict[str, int] | None:
    """As the JSON column holds them: the limits given, None when there are none."""
    if limits is None:
        return None
    given = {name: value for name, value in limits.model_dump().items() if value is not None}
    return given or None


# ---- scopes --------------------------------------------------------------------------------
ModelName = Annotated[str, Field(pattern=MODEL_PATTERN)]
Endpoint = Literal["completions", "chat.completions", "models"]
INFERENCE_ENDPOINTS: tuple[str, ...] = get_args(Endpoint)


class KeyScopeFields(BaseModel):
    models: list[ModelName] | None = Field(
        None,
        max_length=64,
        description="served model names or glob patterns (e.g. qwen*); absent: every model",
    )
    endpoints: list[Endpoint] | None = Field(
        None,
        max_length=len(INFERENCE_ENDPOINTS),
        description=f"of {', '.join(INFERENCE_ENDPOINTS)}; absent: every inference endpoint",
    )


# ---- bodies --------------------------------------------------------------------------------
class KeyCreate(KeyScopeFields):
    """A new key; every field optional (an empty body: a key like before, without expiry)."""

    model_config = ConfigDict(extra="forbid", strict=True)

    name: str | None = Field(None, min_length=1, max_length=128)
    expires_at: IsoDateTime | None = Field(None, description="refused from this time on")
    duration: str | None = Field(
        None, pattern=DURATION_PATTERN, description='expires this long after creation: "30d"'
    )
    limits: ScopedLimits | None = None

    def expiry(self, now: datetime) -> datetime | None:
        if self.expires_at is not None and self.duration is not None:
            raise ValueError("give expires_at or duration, not both")
        if self.duration is not None:
            return now + parse_duration(self.duration)
        return as_utc(self.expires_at)


class KeyPatch(KeyCreate):
    """Only the fields given change; null removes an expiry, a scope or the key's limits."""


class KeyRotate(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    grace_seconds: int = Field(
        0, ge=0, le=MAX_GRACE_S, description="how long the old key keeps working"
    )


# ---- what is shown -------------------------------------------------------------------------
def key_state(key: Any, now: datetime) -> str:
    if key.revoked_at is not None:
        return "revoked"
    if key.grace_ends_at is not None:
        return "rotated"
    expires_at = as_utc(key.expires_at)
    if expires_at is not None and expires_at <= now:
        return "expired"
    if expires_at is not None and expires_at - now <= EXPIRING_WITHIN:
        return "expiring"
    return "active"


def ended_at(key: Any) -> datetime | None:
    """When the key stops working (its expiry, or its grace after a rotation)."""
    ends = [as_utc(t) for t in (key.expires_at, key.grace_ends_at) if t is not None]
    return min(ends) if ends else None


class ApiKeyOut(BaseModel):
    """What may be shown about a key after creation: never the key itself."""

    model_config = ConfigDict(from_attributes=True)

    id: int
    tenant_id: int
    prefix: str
    name: str | None = None
    created_at: datetime
    last_used_at: datetime | None
    revoked_at: datetime | None
    expires_at: datetime | None = None
    grace_ends_at: datetime | None = Field(None, description="rotated: works until then")
    replaced_by_id: int | None = Field(None, description="rotated: the key that replaced it")
    lineage_id: int | None = Field(
        None, description="the first key of its rotations: they share its limits' counters"
    )
    models: list[str] | None = None
    endpoints: list[str] | None = None
    limits: dict[str, int] | None = None

    @computed_field(description="active, expiring (within 7 days), expired, revoked or rotated")
    @property
    def state(self) -> str:
        return key_state(self, utcnow())
