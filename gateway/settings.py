"""`conveyor serve` settings: every flag is also a `CONVEYOR_*` environment variable.

Precedence: command-line flag, then environment variable, then the default. The engine's
settings are `runtime.config.EngineConfig`'s fields, inherited, not retyped.
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import Field, field_validator
from pydantic_settings import BaseSettings, NoDecode, SettingsConfigDict

from runtime.config import EngineConfig

DEFAULT_DATABASE_URL = "sqlite:///conveyor.db"
# Used only when no --key-hash-secret is set: fine for the embedded demo, never for production.
DEV_KEY_HASH_SECRET = "conveyor-dev-secret-change-me"


class ServeSettings(EngineConfig, BaseSettings):
    """The engine's settings (inherited from `EngineConfig`, declared there once) and the
    server's own; `conveyor serve`'s flags are generated from these fields."""

    model_config = SettingsConfigDict(env_prefix="CONVEYOR_", extra="ignore")

    # ---- HTTP --------------------------------------------------------------------------------
    host: str = Field("127.0.0.1", description="address to bind")
    port: int = Field(8000, ge=0, le=65535)
    max_body_bytes: int = Field(1 << 20, ge=1024, description="larger request bodies get 413")
    drain_timeout: float = Field(30.0, ge=0, description="seconds in-flight requests may finish")
    max_waiting_requests: int = Field(
        1024, ge=0, description="sequences allowed to wait beyond --max-num-seqs before 503"
    )
    log_level: Literal["debug", "info", "warning", "error", "critical"] | None = Field(
        None,
        description="default: the level of `conveyor --log-level` (WARNING by default)",
        json_schema_extra={"lowercase": True},
    )
    # ---- state -------------------------------------------------------------------------------
    database_url: str = Field(DEFAULT_DATABASE_URL, description="SQLite or PostgreSQL URL")
    auto_migrate: bool = Field(True, description="upgrade the database schema at start")
    redis_url: str | None = Field(None, description="default: in-process fakeredis")
    rate_limit_on_error: Literal["open", "closed"] = Field(
        "open", description="Redis unreachable: serve without limits (open) or answer 503"
    )
    auth_stale_for: float = Field(
        300.0,
        ge=0,
        description="while the database is unreachable, keys valid at their last check keep"
        " working this long (default 300; 0: refuse them with 503 once their cached answer"
        " expires)",
        json_schema_extra={"metavar": "SECONDS"},
    )
    key_hash_secret: str | None = Field(None, description="HMAC secret for API keys")
    admin_tokens: Annotated[list[str], NoDecode] = Field(
        default_factory=list, description="comma-separated bearer tokens for /admin"
    )
    create_demo_tenant: bool = Field(
        True,
        description="create a demo tenant and key on a first start",
        json_schema_extra={"flag": "--no-demo-tenant"},
    )
    audit_spool_path: str = Field(
        "conveyor-audit.spool", description="audit records wait here while the database is down"
    )
    audit: bool = Field(True, description="write the audit log (--no-audit: off, to benchmark)")
    audit_retention_days: float | None = Field(
        None, gt=0, description="prune audit records older than this (default: keep them all)"
    )

    # ---- the Kubernetes Inference Gateway ------------------------------------------------------
    inference_objectives: Annotated[dict[str, int], NoDecode] = Field(
        default_factory=dict,
        description="InferenceObjective names and the priorities they run at, as"
        " name=priority,... (x-llm-d-inference-objective); default: none",
        json_schema_extra={"metavar": "NAME=PRIORITY,..."},
    )

    @field_validator("inference_objectives", mode="before")
    @classmethod
    def parse_objectives(cls, value: object) -> object:
        """`critical=0,standard=1,sheddable=2` (the chart writes this form), or a mapping."""
        if not isinstance(value, str):
            return value
        pairs = [item.partition("=") for item in value.split(",") if item.strip()]
        if any(not sep or not name.strip() for name, sep, _ in pairs):
            raise ValueError("inference objectives are name=priority pairs, comma-separated")
        return {name.strip(): priority.strip() for name, _, priority in pairs}

    @field_validator("admin_tokens", mode="before")
    @classmethod
    def split_comma_list(cls, value: object) -> object:
        """`CONVEYOR_ADMIN_TOKENS=a,b` as people write it."""
        if isinstance(value, str):
            return [token.strip() for token in value.split(",") if token.strip()]
        return value

    @field_validator("redis_url", "model", "log_level", "audit_retention_days", mode="before")
    @classmethod
    def empty_is_none(cls, value: object) -> object:
        return None if value == "" else value

    @field_validator("log_level", mode="before")
    @classmethod
    def lower_case_level(cls, value: object) -> object:
        """`INFO` and `info` alike, as the chart allows both."""
        return value.lower() if isinstance(value, str) else value

    def engine_config(self) -> EngineConfig:
        return EngineConfig(**{name: getattr(self, name) for name in EngineConfig.model_fields})

    @property
    def effective_key_hash_secret(self) -> str:
        return self.key_hash_secret or DEV_KEY_HASH_SECRET
