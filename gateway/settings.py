"""`conveyor serve` settings: every flag is also a `CONVEYOR_*` environment variable.

Precedence: command-line flag, then environment variable, then the default here. The engine
flags mirror `runtime.config.EngineConfig` field for field (same names, same defaults).
"""

from __future__ import annotations

from dataclasses import fields
from typing import Annotated, Literal

from pydantic import Field, field_validator
from pydantic_settings import BaseSettings, NoDecode, SettingsConfigDict

from runtime.config import EngineConfig

DEFAULT_DATABASE_URL = "sqlite:///conveyor.db"
# Used only when no --key-hash-secret is set: fine for the embedded demo, never for production.
DEV_KEY_HASH_SECRET = "conveyor-dev-secret-change-me"


class ServeSettings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="CONVEYOR_", extra="ignore")

    # ---- HTTP --------------------------------------------------------------------------------
    host: str = "127.0.0.1"
    port: int = Field(8000, ge=0, le=65535)
    max_body_bytes: int = Field(1 << 20, ge=1024)
    drain_timeout: float = Field(30.0, ge=0, description="seconds in-flight requests may finish")
    max_waiting_requests: int = Field(
        1024, ge=0, description="sequences allowed to wait beyond --max-num-seqs before 503"
    )
    log_level: Literal["debug", "info", "warning", "error", "critical"] | None = Field(
        None, description="None: the level of `conveyor --log-level` (WARNING by default)"
    )
    # ---- state -------------------------------------------------------------------------------
    database_url: str = DEFAULT_DATABASE_URL
    auto_migrate: bool = True
    redis_url: str | None = None  # None: in-process fakeredis
    rate_limit_on_error: Literal["open", "closed"] = "open"
    rate_limit_burst: int = Field(10, ge=0)
    key_hash_secret: str | None = None
    admin_tokens: Annotated[list[str], NoDecode] = Field(default_factory=list)
    create_demo_tenant: bool = True
    audit_spool_path: str = "conveyor-audit.spool"  # audit records wait here while the DB is down
    audit: bool = Field(True, description="write the audit log (--no-audit: off, to benchmark)")
    audit_retention_days: float | None = Field(
        None, gt=0, description="prune audit records older than this (None: keep them all)"
    )
    # ---- engine (runtime.config.EngineConfig) ------------------------------------------------
    model: str | None = None
    served_model_name: Annotated[list[str] | None, NoDecode] = None
    dtype: str = "auto"
    device: str = "auto"
    block_size: int = 16
    num_kv_blocks: int | None = None
    kv_cache_memory: str = "2GiB"
    swap_space: float = 1.0
    max_num_seqs: int = 256
    max_batch_tokens: int = 2048
    max_model_len: int | None = None
    scheduling: Literal["priority", "fcfs", "static"] = "priority"
    preemption_mode: Literal["auto", "swap", "recompute"] = "auto"
    priority_aging: float | None = None
    enable_prefix_caching: bool = True
    enforce_eager: bool = False
    seed: int = 0

    @field_validator("admin_tokens", mode="before")
    @classmethod
    def split_comma_list(cls, value: object) -> object:
        """`CONVEYOR_ADMIN_TOKENS=a,b` as people write it."""
        if isinstance(value, str):
            return [token.strip() for token in value.split(",") if token.strip()]
        return value

    @field_validator("served_model_name", mode="before")
    @classmethod
    def split_names(cls, value: object) -> object:
        """`CONVEYOR_SERVED_MODEL_NAME="a b"` or `a,b`; empty: derived from the model."""
        if isinstance(value, str):
            return value.replace(",", " ").split() or None
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
        return EngineConfig(**{f.name: getattr(self, f.name) for f in fields(EngineConfig)})

    @property
    def effective_key_hash_secret(self) -> str:
        return self.key_hash_secret or DEV_KEY_HASH_SECRET
