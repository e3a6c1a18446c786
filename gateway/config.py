"""Typed, validated gateway settings: one YAML file plus ``AGENTGW_*`` environment overrides.

Precedence (highest first): keyword arguments, environment (``AGENTGW_LISTEN__PORT=9000``,
nested keys joined by ``__``), the YAML file, defaults. An invalid value fails at start-up with
one message naming the key (see :func:`load_config`).
"""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator
from pydantic_settings import BaseSettings, PydanticBaseSettingsSource, SettingsConfigDict

from gateway.core.planner import PlannerParams
from gateway.core.router import RoutingParams

PoolRole = Literal["first_turn", "warm", "any"]


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class ListenConfig(_Strict):
    host: str = "127.0.0.1"
    port: int = Field(8000, ge=0, le=65535)


class EngineConfig(_Strict):
    name: str = Field(min_length=1, max_length=64)
    url: str
    model: str = Field(min_length=1)
    kv_events: str | None = None
    """ZMQ endpoint of the engine's KV-event publisher, e.g. ``tcp://127.0.0.1:5557``."""
    control_url: str | None = None
    """engine_ext control API base URL, when the engine runs the plugin."""

    @field_validator("url", "control_url")
    @classmethod
    def _http_url(cls, v: str | None) -> str | None:
        if v is not None and not v.startswith(("http://", "https://")):
            raise ValueError("must start with http:// or https://")
        return v.rstrip("/") if v else v


class PoolConfig(_Strict):
    name: str = Field(min_length=1, max_length=64)
    role: PoolRole = "any"
    engines: list[EngineConfig] = Field(min_length=1)


class TimeoutsConfig(_Strict):
    connect_s: float = Field(2.0, gt=0)
    read_s: float = Field(600.0, gt=0)
    """Longest silence accepted from an engine while a response is being read."""
    health_interval_s: float = Field(2.0, gt=0)
    health_timeout_s: float = Field(1.0, gt=0)
    metrics_interval_s: float = Field(1.0, gt=0)


class LimitsConfig(_Strict):
    max_body_bytes: int = Field(32 * 1024 * 1024, gt=0)
    max_connections_per_engine: int = Field(1024, gt=0)
    eject_after_failures: int = Field(2, ge=1)
    readmit_after_successes: int = Field(1, ge=1)
    retry_after_s: int = Field(2, ge=0)
    """Value of the ``Retry-After`` header on a 503."""


class ModelConfig(_Strict):
    """How the gateway computes a model's prompt tokens and vLLM block hashes exactly."""

    name: str = Field(min_length=1)
    tokenizer: str | None = None
    """A model directory with tokenizer.json and a chat template; without it the gateway falls
    back to an approximate text-prefix index."""
    block_size: int = Field(128, gt=0)
    hash_seed: str | None = "0"
    """The engines' PYTHONHASHSEED (they run --prefix-caching-hash-algo sha256_cbor)."""


class AnalysisConfig(_Strict):
    """Prompt analysis (render, tokenize, hash) off the event loop (gateway/service/analysis.py)."""

    mode: Literal["process", "thread", "inline"] = "process"
    """process: worker processes; thread: threads; inline: on the event loop (comparisons only)."""
    workers: int = Field(1, ge=1, le=64)
    """Workers of the large-prompt lane."""
    small_workers: int = Field(1, ge=1, le=64)
    """Workers of the small-prompt lane."""
    inline_chars: int = Field(2048, ge=0)
    """Prompts with fewer characters of text are analysed on the event loop (< 1 ms of work)."""
    small_chars: int = Field(32_768, ge=0)
    """Prompts with fewer characters of text go to the small lane."""
    large_nice: int = Field(10, ge=0, le=19)
    """CPU niceness of large-lane worker processes (the loop and the small lane preempt them)."""
    budget_ms: float = Field(2000.0, gt=0)
    """Longest wait for one analysis; past it the request is routed on the approximate index."""
    max_backlog: int = Field(16, ge=1)
    """Requests queued per worker beyond which new ones are routed approximately at once."""
    cache_bytes: int = Field(512 * 1024 * 1024, gt=0)
    """Content-keyed token cache, all workers together (fits a 24 GiB machine beside engines)."""
    session_tokens_bytes: int = Field(64 * 1024 * 1024, gt=0)
    """Token ids of each session's last prompt, kept for KV prefetch."""


class RoutingConfig(_Strict):
    profile: Literal[
        "agentic", "precise_prefix", "cache_aware", "least_loaded", "round_robin", "session_hash"
    ] = "agentic"
    first_turn_threshold_tokens: int = Field(4096, ge=0)
    """Estimated uncached tokens at or above which a request goes to the first-turn pool."""
    sticky_max_queue: int = Field(16, ge=0)
    saturation_max_queue: int = Field(64, ge=0)
    prefill_s_per_token: float = Field(2e-5, ge=0)
    queue_s_per_request: float = Field(0.05, ge=0)
    weights: dict[str, float] = Field(default_factory=lambda: dict(RoutingParams().weights))
    """Scorer weights of the ``agentic`` profile (see gateway/core/policies/scorers.py)."""
    forward_priority: bool = False
    """Forward hinted priority as vLLM's ``priority`` (engines run --scheduling-policy priority)."""
    approx_chunk_chars: int = Field(512, gt=0)
    index_capacity_blocks: int = Field(1 << 20, gt=0)
    """Per engine: blocks remembered by the prefix index."""

    def params(self) -> RoutingParams:
        """The pure router's parameters (the fields both share)."""
        return RoutingParams(**_shared(self, RoutingParams))


class SessionsConfig(_Strict):
    backend: Literal["memory", "redis"] = "memory"
    redis_url: str = "redis://127.0.0.1:6379/0"
    capacity: int = Field(100_000, gt=0)
    ttl_s: float = Field(3600.0, gt=0)


class HintsConfig(_Strict):
    on_invalid: Literal["reject", "ignore"] = "reject"
    """reject: 400 naming the field; ignore: drop the hints, add an ``x-agentgw-warning`` header."""


class MigrationConfig(_Strict):
    """Inter-turn KV placement through engine_ext's control API (engines with ``control_url``)."""

    enabled: bool = True
    control_token: str | None = None
    max_per_engine: int = Field(2, ge=1)
    """Concurrent prefetches per target engine, so migrations never starve live traffic."""
    prefetch_timeout_s: float = Field(120.0, gt=0)
    pin_margin_s: float = Field(5.0, ge=0)
    max_pin_s: float = Field(600.0, gt=0)
    demote_after_s: float = Field(120.0, gt=0)
    default_gap_s: float = Field(10.0, ge=0)
    rebalance_queue: int = Field(16, ge=1)
    max_target_queue: int = Field(8, ge=0)
    kv_bytes_per_token: int = Field(8192, gt=0)
    move_bytes_per_s: float = Field(2e9, gt=0)

    def params(self) -> PlannerParams:
        """The pure planner's parameters (the fields both share)."""
        return PlannerParams(**_shared(self, PlannerParams))


def _shared(model: BaseModel, target: type) -> dict[str, Any]:
    names = {f.name for f in dataclasses.fields(target)}
    return {k: v for k, v in model.model_dump().items() if k in names}


class GatewayConfig(BaseSettings):
    """The whole configuration. See README.md for a reference of every key."""

    model_config = SettingsConfigDict(
        env_prefix="AGENTGW_", env_nested_delimiter="__", extra="forbid", frozen=True
    )

    listen: ListenConfig = ListenConfig()
    pools: list[PoolConfig] = Field(default_factory=list)
    timeouts: TimeoutsConfig = TimeoutsConfig()
    limits: LimitsConfig = LimitsConfig()
    models: list[ModelConfig] = Field(default_factory=list)
    routing: RoutingConfig = RoutingConfig()
    sessions: SessionsConfig = SessionsConfig()
    hints: HintsConfig = HintsConfig()
    migration: MigrationConfig = MigrationConfig()
    analysis: AnalysisConfig = AnalysisConfig()

    @model_validator(mode="after")
    def _unique_names(self) -> GatewayConfig:
        pools = [p.name for p in self.pools]
        if len(pools) != len(set(pools)):
            raise ValueError(f"pool names must be unique, got {pools}")
        engines = [e.name for p in self.pools for e in p.engines]
        if len(engines) != len(set(engines)):
            raise ValueError(f"engine names must be unique across pools, got {engines}")
        return self

    @classmethod
    def settings_customise_sources(
        cls,
        settings_cls: type[BaseSettings],
        init_settings: PydanticBaseSettingsSource,
        env_settings: PydanticBaseSettingsSource,
        dotenv_settings: PydanticBaseSettingsSource,
        file_secret_settings: PydanticBaseSettingsSource,
    ) -> tuple[PydanticBaseSettingsSource, ...]:
        return (env_settings, init_settings)


class ConfigError(Exception):
    """A configuration problem, with a message naming the offending key."""


def _format(err: ValidationError) -> str:
    first = err.errors()[0]
    key = ".".join(str(p) for p in first["loc"]) or "<root>"
    more = f" (and {err.error_count() - 1} more)" if err.error_count() > 1 else ""
    return f"invalid config key '{key}': {first['msg']}{more}"


def load_config(path: str | os.PathLike[str] | None = None, **overrides: Any) -> GatewayConfig:
    """Read ``path`` (YAML) if given, apply environment and keyword overrides, validate."""
    data: dict[str, Any] = {}
    if path is not None:
        try:
            raw = yaml.safe_load(Path(path).read_text())
        except OSError as exc:
            raise ConfigError(f"cannot read config file {path}: {exc.strerror}") from None
        except yaml.YAMLError as exc:
            raise ConfigError(f"config file {path} is not valid YAML: {exc}") from None
        if raw is not None and not isinstance(raw, dict):
            raise ConfigError(f"config file {path} must hold a mapping at the top level")
        data = raw or {}
    data.update(overrides)
    try:
        return GatewayConfig(**data)
    except ValidationError as exc:
        raise ConfigError(_format(exc)) from None
