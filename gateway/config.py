"""Typed, validated gateway settings: one YAML file plus ``AGENTGW_*`` environment overrides.

Precedence (highest first): keyword arguments, environment (``AGENTGW_LISTEN__PORT=9000``,
nested keys joined by ``__``), the YAML file, defaults. An invalid value fails at start-up with
one message naming the key (see :func:`load_config`).
"""

from __future__ import annotations

import dataclasses
import logging
import os
import warnings
from pathlib import Path
from typing import Any, Literal, cast

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator
from pydantic_settings import BaseSettings, PydanticBaseSettingsSource, SettingsConfigDict

from gateway.core.planner import PlannerParams
from gateway.core.router import RoutingParams, with_planner

log = logging.getLogger("agentgw.config")

PoolRole = Literal["first_turn", "warm", "any"]
RoutingProfile = Literal[
    "agentic", "precise_prefix", "cache_aware", "least_loaded", "round_robin", "session_hash"
]
RoutingSplit = Literal["cost", "wall"]


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class ListenConfig(_Strict):
    host: str = "127.0.0.1"
    port: int = Field(8000, ge=0, le=65535)


class EngineConfig(_Strict):
    name: str = Field(min_length=1, max_length=64)
    url: str
    model: str = Field(min_length=1)
    aliases: list[str] = Field(default_factory=list)
    """More names the engine serves the same model under (vLLM's ``--served-model-name`` after
    the first); requests for any of them are routed here too."""
    kv_events: str | None = None
    """ZMQ endpoint of the engine's KV-event publisher, e.g. ``tcp://127.0.0.1:5557``."""
    control_url: str | None = None
    """engine_ext control API base URL, when the engine runs the plugin."""
    kv_hints: bool = False
    """The engine's engine_ext reads KV hint envelopes from ``kv_transfer_params.kv_hints``
    (docs/engine_ext.md): a turn's pin or release then rides on the turn's request as an
    envelope action, and the planner's ``stay`` / ``demote`` pin and the session end's release
    are not sent to the control API after the turn. Needs ``control_url``. Off: the pin rides
    in ``kv_transfer_params.agentgw`` and the control calls are sent (the default)."""

    @field_validator("url", "control_url")
    @classmethod
    def _http_url(cls, v: str | None) -> str | None:
        if v is not None and not v.startswith(("http://", "https://")):
            raise ValueError("must start with http:// or https://")
        return v.rstrip("/") if v else v

    @model_validator(mode="after")
    def _kv_hints_need_control(self) -> EngineConfig:
        if self.kv_hints and self.control_url is None:
            raise ValueError(
                "kv_hints needs control_url (the envelope's actions are engine_ext's control API's)"
            )
        return self


class PoolConfig(_Strict):
    name: str = Field(min_length=1, max_length=64)
    role: PoolRole = "any"
    engines: list[EngineConfig] = Field(min_length=1)


class TimeoutsConfig(_Strict):
    connect_s: float = Field(2.0, gt=0)
    read_s: float = Field(600.0, gt=0)
    """Longest silence accepted from an engine while a non-streamed response is being read."""
    first_byte_s: float = Field(30.0, gt=0)
    """Longest wait for an engine's response headers; past it the engine counts as failing and
    the request (nothing of it sent yet) is retried on another engine of the pool."""
    inter_chunk_s: float = Field(120.0, gt=0)
    """Longest silence within a streamed response (before the first token too); past it the
    stream ends with an error event and the engine counts as failing."""
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
    panic_threshold: float = Field(0.0, ge=0, le=1)
    """Envoy-style panic: when the fraction of a pool's engines passing probes is at or below
    this, routing ignores probe failures in that pool (engines that refused a connection stay
    out), so a slow-to-answer but live pool is never emptied. 0: only when none passes."""
    max_session_body_bytes: int = Field(64 * 1024, gt=0)
    """Body limit of the session API (``/v1/agent/sessions/...``)."""
    max_admin_body_bytes: int = Field(1024 * 1024, gt=0)
    """Body limit of the admin API (``PUT /admin/pools``)."""
    max_buffered_body_bytes: int = Field(1024 * 1024 * 1024, gt=0)
    """Request-body bytes held at once, all requests together (a generation request's until its
    response ends, the other routes' while they are read), counted as they arrive (never on the
    declared ``Content-Length``); a body that would go past it gets a 503 ``overloaded`` with
    ``Retry-After`` (gateway/api/body_budget.py)."""
    max_buffered_body_bytes_per_tenant: int = Field(256 * 1024 * 1024, gt=0)
    """The part of ``limits.max_buffered_body_bytes`` one tenant may hold (one client address when
    no API keys are configured), so one tenant's bodies always leave room for the others'; past it
    a 429 ``tenant_body_budget`` with ``Retry-After``. At most ``max_buffered_body_bytes``."""


class ModelConfig(_Strict):
    """How the gateway computes a model's prompt tokens and vLLM block hashes exactly."""

    name: str = Field(min_length=1)
    tokenizer: str | None = None
    """A model directory with tokenizer.json and a chat template; without it the gateway falls
    back to an approximate text-prefix index."""
    block_size: int = Field(128, gt=0)
    hash_seed: str | None = "0"
    """The engines' PYTHONHASHSEED (they run --prefix-caching-hash-algo sha256_cbor)."""
    fast_bpe: bool = True
    """Encode with tiktoken's byte-level BPE core when it reproduces this tokenizer (checked on
    a probe at start-up and on a sample of live encodes against the tokenizer itself; the first
    disagreement turns it off), else with ``tokenizers`` (gateway/analysis/fast_bpe.py)."""


class AnalysisConfig(_Strict):
    """Prompt analysis (render, tokenize, hash) off the event loop (gateway/analysis/analyzer.py)."""

    mode: Literal["process", "thread", "inline"] = "process"
    """process: worker processes; thread: threads; inline: on the event loop (comparisons only)."""
    workers: int = Field(1, ge=1, le=64)
    """Workers of the large-prompt lane."""
    small_workers: int = Field(1, ge=1, le=64)
    """Workers of the small-prompt lane."""
    inline_chars: int = Field(2048, ge=0)
    """Prompts with fewer characters of text are analysed on the event loop (< 1 ms of work)."""
    thread_chars: int = Field(16_384, ge=0)
    """Mode process: prompts with fewer characters (and at least ``inline_chars``) are analysed
    in a thread of the gateway process instead of a worker process (no pickling round trip)."""
    small_chars: int = Field(32_768, ge=0)
    """Prompts with fewer characters of text go to the small lane."""
    large_nice: int = Field(5, ge=0, le=19)
    """CPU niceness of large-lane worker processes (the loop and the small lane preempt them)."""
    budget_ms: float = Field(2000.0, gt=0)
    """Longest wait for one analysis; past it the request is routed on the approximate index."""
    max_backlog: int = Field(64, ge=1)
    """Requests queued per worker beyond which new ones are routed approximately at once (the
    budget bounds the wait too: a request whose predicted wait exceeds it is not queued)."""
    cache_bytes: int = Field(512 * 1024 * 1024, gt=0)
    """Content-keyed token cache, all workers together (fits a 24 GiB machine beside engines)."""
    session_tokens_bytes: int = Field(64 * 1024 * 1024, gt=0)
    """Token ids of each session's last prompt, kept for KV prefetch."""


_ROUTING = RoutingParams()
_PLANNER = PlannerParams()
"""The core's defaults: the config's routing and migration sections take theirs from here."""


class RoutingConfig(_Strict):
    """The router's parameters (:class:`~gateway.core.router.RoutingParams`: every default is
    its), plus what the service needs around it (``role_*``, ``forward_priority``, the index)."""

    # RoutingParams types these as plain str (the router checks them at run time).
    profile: RoutingProfile = cast(RoutingProfile, _ROUTING.profile)
    first_turn_threshold_tokens: int = Field(_ROUTING.first_turn_threshold_tokens, ge=0)
    """Estimated uncached tokens at or above which a request goes to the first-turn pool."""
    sticky_max_queue: int = Field(_ROUTING.sticky_max_queue, ge=0)
    saturation_max_queue: int = Field(_ROUTING.saturation_max_queue, ge=0)
    interactivity_tok_s: float | None = Field(None, ge=0)
    """Deprecated: ``slo.tok_s`` (still read, with a warning, when ``slo.tok_s`` is not set)."""
    knee_move_max_s: float = Field(_ROUTING.knee_move_max_s, ge=0)
    """Most TTFT (s, estimated from uncached tokens and queue) a ``kv_balance`` move may add to
    the turn; past it the turn stays home past the knee. 0: any move."""
    knee_output_tokens: int = Field(_ROUTING.knee_output_tokens, ge=0)
    """A ``kv_balance`` move at a turn's arrival is made only when the decode time it saves over
    this many output tokens (the step beyond 1000 / ``interactivity_tok_s`` ms, at home less at
    the target) exceeds the time to reload the context the target lacks (at
    ``move_bytes_per_s``). 0: any move (for short tool gaps, where the planner cannot move a
    session ahead of its turn). Unset, it is 0 unless the planner moves sessions during their
    tool gaps (``migration.enabled`` and an engine with a ``control_url``): then 30."""
    overflow_wait_tokens: int = Field(_ROUTING.overflow_wait_tokens, ge=0)
    """A turn its home cannot hold moves (``kv_overflow``) only when reloading what the target
    lacks takes less than this many decode steps at home; else it waits there. 0: always move.
    Unset, it is 0 unless the planner moves sessions during their tool gaps: then 222."""
    prefill_s_per_token: float = Field(_ROUTING.prefill_s_per_token, ge=0)
    queue_s_per_request: float = Field(_ROUTING.queue_s_per_request, ge=0)
    cold_home_no_affinity: bool = _ROUTING.cold_home_no_affinity
    """A session whose home holds less than half the prompt the best engine holds is re-scored
    without the home's ``session_affinity`` bonus (``rehome_cold``)."""
    new_session_load: bool = _ROUTING.new_session_load
    """A new session that the scores send to an engine for a prefix it holds (a shared system
    prompt) goes to the engine with the lowest estimated time to first token (uncached tokens
    x ``prefill_s_per_token`` + queue x ``queue_s_per_request``) when that is lower
    (``new_session_load``): sessions spread instead of piling onto that engine."""
    split: RoutingSplit = cast(RoutingSplit, _ROUTING.split)
    """First-turn / warm split of the ``agentic`` profile: ``cost`` prices each request on both
    sides with the engine cost model below (gateway/core/policies/split.py) and the load the
    gateway measures (in-flight prefills and decodes per engine): an idle warm engine takes a
    first turn, a busy one leaves it to the first-turn pool; ``wall`` is the fixed
    ``first_turn_threshold_tokens``."""
    cost_prefill_ms: tuple[float, float, float] = _ROUTING.cost_prefill_ms
    """Pass time of T uncached tokens: p0 + p1*T + p2*T^2 ms (fit to the engines' step times)."""
    cost_chunk_tokens: int = Field(_ROUTING.cost_chunk_tokens, gt=0)
    """min(--max-num-batched-tokens, --long-prefill-token-threshold) of the engines."""
    cost_decode_ms: tuple[float, float, float] = _ROUTING.cost_decode_ms
    """Decode step at KV use u: max(1, d0 + d1*u + d2*u^2) ms."""
    cost_decode_seq_ms: float = Field(_ROUTING.cost_decode_seq_ms, ge=0)
    """Decode step added per decoding sequence (ms; 0 unless the engines' step grows with the batch)."""
    cost_decode_kv_ms_per_mtok: float = Field(_ROUTING.cost_decode_kv_ms_per_mtok, ge=0)
    """Decode step added per million context tokens read, the context taken as u times
    ``cost_kv_capacity_tokens`` (ms; an H200 fit: 42.15)."""
    cost_kv_capacity_tokens: int = Field(_ROUTING.cost_kv_capacity_tokens, ge=0)
    """One engine's KV capacity in tokens for the context term (0: unknown, term left out)."""
    cost_decode_seq_tokens: int = Field(_ROUTING.cost_decode_seq_tokens, ge=0)
    """Typical decoding sequence context, to estimate the batch at the decode knee (0: one sequence)."""
    kv_bytes_per_token: int = Field(_ROUTING.kv_bytes_per_token, gt=0)
    """KV bytes per token, for pricing a session's KV move in the split's cost rule."""
    move_bytes_per_s: float = Field(_ROUTING.move_bytes_per_s, ge=0)
    """Transfer rate of a KV move between engines (bytes/s), for the split's cost rule."""
    split_move_weight: float = Field(_ROUTING.split_move_weight, ge=0)
    """Weight of the later KV move in the first-turn pool's cost (work-conserving split)."""
    split_interference_weight: float = Field(_ROUTING.split_interference_weight, ge=0)
    """Weight of the decode interference a warm engine's uncached prefill causes (work-conserving split)."""
    role_controller: bool = False
    """Re-assign engines between ``first_turn`` and ``warm`` from the measured prefill backlog and
    decode load (gateway/core/roles.py: hysteresis, one change per tick, minimum dwell)."""
    role_interval_s: float = Field(1.0, ge=0.05, le=60)
    """Period of the role controller's tick."""
    role_backlog_tokens_per_engine: int = Field(65_536, gt=0)
    """Prefill backlog (uncached prompt tokens, all engines) one first-turn engine is sized for."""
    role_min_dwell_s: float = Field(30.0, ge=0)
    """An engine keeps a role at least this long before the controller changes it again."""
    weights: dict[str, float] = Field(default_factory=lambda: dict(_ROUTING.weights))
    """Scorer weights of the ``agentic`` profile (see gateway/core/policies/scorers.py)."""
    forward_priority: bool = False
    """Forward hinted priority as vLLM's ``priority`` (engines run --scheduling-policy priority)."""
    approx_chunk_chars: int = Field(512, gt=0)
    index_capacity_blocks: int = Field(1 << 20, gt=0)
    """Per engine: blocks remembered by the prefix index."""

    def params(self) -> RoutingParams:
        """The pure router's parameters (the fields both share; a deprecated key left unset
        takes the router's default)."""
        return RoutingParams(**{k: v for k, v in _shared(self, RoutingParams).items() if v is not None})


class SloConfig(_Strict):
    """The service level placement serves (AgentX's): each turn's time to first token and its
    decode speed. The decision record predicts both for every routed turn
    (``predicted_ttft_ms``, ``predicted_tok_s``) and counts the predicted misses
    (``agentgw_route_predicted_misses_total``)."""

    ttft_ms: float = Field(1000.0, gt=0)
    """A turn's time to first token should be at most this."""
    tok_s: float = Field(50.0, ge=0)
    """A turn should decode at least this fast (tokens/s): the ``agentic`` picker moves a turn
    whose home's KV would pass the decode knee for this speed (the step of the ``cost_decode_ms``
    model reaching 1000 / this ms) to an engine that stays under it (reason ``kv_balance``).
    0: no decode-speed bound (only the fit check at a full cache)."""


class SessionsConfig(_Strict):
    backend: Literal["memory", "redis"] = "memory"
    redis_url: str = "redis://127.0.0.1:6379/0"
    capacity: int = Field(100_000, gt=0)
    ttl_s: float = Field(3600.0, gt=0)
    redis_timeout_s: float = Field(0.5, gt=0)
    """Connect and command timeout of the Redis backend; past it the store runs degraded."""
    redis_retry_s: float = Field(1.0, gt=0)
    """While degraded, how often Redis is tried again (requests in between use the local view)."""
    redis_max_conflicts: int = Field(16, ge=1)
    """WATCH/MULTI attempts of one update before it gives up with a 503 (busy session)."""
    local_capacity: int = Field(100_000, gt=0)
    """Sessions kept in the replica's local view of a Redis store (used while Redis is down)."""
    share_load_s: float = Field(0.25, ge=0)
    """With the Redis backend, how often each replica writes its in-flight requests per engine to
    Redis and reads the other replicas' (gateway/service/shared_load.py), so it routes on everyone's
    load between two scrapes of the engines' gauges; 0: off."""
    discover_response_owners: bool = True
    """When the record of which engine holds a stored Responses-API response is missing (Redis
    restarted empty, or expired while the engine kept the response), ask the engines
    (``GET /v1/responses/{id}``) and remember the one that has it. Only where ``auth.tenants`` is
    empty: with tenants, an engine's answer cannot tell whose response it is."""


def _sha256_digests(v: list[str]) -> list[str]:
    for d in v:
        if len(d) != 64 or any(c not in "0123456789abcdefABCDEF" for c in d):
            raise ValueError("must be 64 hex characters (a SHA-256 digest)")
    return [d.lower() for d in v]


class TenantConfig(_Strict):
    """A tenant: its API keys (stored hashed), its limits and the models it may use."""

    name: str = Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_.-]+$")
    """The tenant's name: prefixes its session and response ids (``<name>:<id>``)."""
    key_sha256: list[str] = Field(default_factory=list)
    """Hex SHA-256 digests of the tenant's keys (``printf %s KEY | sha256sum``)."""
    key_env: list[str] = Field(default_factory=list)
    """Environment variables holding keys in clear; read once at start-up, then kept hashed."""
    models: list[str] | None = None
    """Models this tenant may use (None: all)."""
    requests_per_s: float | None = Field(None, gt=0)
    """Requests admitted per second (token bucket; past it a 429 with ``Retry-After``)."""
    tokens_per_s: float | None = Field(None, gt=0)
    """Prompt plus completion tokens per second (token bucket; past it a 429)."""
    burst_s: float = Field(2.0, gt=0)
    """Rate buckets hold ``rate * burst_s`` (at least one request's worth)."""
    max_concurrent: int | None = Field(None, gt=0)
    """Requests (streams) of this tenant in flight at once."""
    share: float = Field(1.0, gt=0, le=1_000_000)
    """The tenant's weight when capacity is short: the gateway's and each engine's wait queue
    serve waiting tenants in proportion to their shares (a tenant with share 2 gets twice the
    slots of one with share 1 while both wait); a full queue pushes out the newest waiter of the
    tenant furthest over its share; while requests wait or refused ones are booked, a tenant that
    has had more than its share of the last 10 s is refused first; and refused sessions'
    retries are booked at each tenant's share of the rate slots free up."""
    max_sessions: int | None = Field(None, gt=0)
    """Sessions this tenant may hold in the session store; a new one past it makes the tenant's
    own least recently active session be forgotten (never another tenant's). None: an equal
    share of what ``sessions.capacity`` leaves after the tenants that set it."""

    @field_validator("key_sha256")
    @classmethod
    def _hex_digests(cls, v: list[str]) -> list[str]:
        return _sha256_digests(v)


class AuthConfig(_Strict):
    """API keys. With none configured every request is the anonymous tenant, which is only
    allowed on a loopback address unless ``allow_unauthenticated`` says otherwise."""

    tenants: list[TenantConfig] = Field(default_factory=list)
    """The tenants and their keys; none (and no admin key): every caller is anonymous."""
    admin_key_sha256: list[str] = Field(default_factory=list)
    """Hex SHA-256 digests of admin keys (``/debug/*``, ``/metrics``, any tenant's sessions)."""
    admin_key_env: list[str] = Field(default_factory=list)
    """Environment variables holding admin keys in clear; read once at start-up, then hashed."""
    cache_salt_secret_env: str | None = None
    """Environment variable with a secret mixed into each tenant's ``cache_salt``."""
    allow_unauthenticated: bool = False
    """Allow running without any key on a non-loopback address (not recommended)."""

    @field_validator("admin_key_sha256")
    @classmethod
    def _hex_digests(cls, v: list[str]) -> list[str]:
        return _sha256_digests(v)


class AdmissionConfig(_Strict):
    """In-flight limits and the bounded wait queue in front of the engines."""

    max_inflight: int = Field(4096, gt=0)
    """Requests in flight through the gateway at once (all tenants)."""
    max_queue: int = Field(1024, ge=0)
    """Requests waiting for a global slot; past it a 503 with ``Retry-After``."""
    queue_timeout_s: float = Field(30.0, gt=0)
    """Longest wait for a slot before a 503."""
    max_inflight_per_engine: int = Field(1024, gt=0)
    """Requests in flight to one engine at once."""
    max_queue_per_engine: int = Field(256, ge=0)
    """Requests waiting for a slot on one engine; past it a 503 with ``Retry-After``."""
    retry_after_s: int = Field(1, ge=0)
    """The least ``Retry-After`` of an admission 503; past it, the estimated wait for the
    tenant's next slot (rate-limit 429s say when the bucket refills)."""
    max_retry_bookings: int = Field(4096, ge=0)
    """Refused requests whose retry time the gateway keeps (their session's place at the time
    its ``Retry-After`` names; oldest dropped past it); 0: no bookings, ``Retry-After`` is only
    an estimate."""
    starts_per_tick: int = Field(32, gt=0)
    """Requests that may start their analysis in one event-loop iteration; a burst beyond it
    waits for the next iterations, so timers (upstream connect, probes) are not starved."""


class ServerConfig(_Strict):
    """Limits the HTTP server enforces on clients (see gateway/api/server.py)."""

    max_connections: int = Field(8192, gt=0)
    """Open client connections; past it new ones get a 503 and are closed (but for
    ``server.probe_reserve``)."""
    probe_reserve: int = Field(16, ge=0)
    """Connections past ``server.max_connections`` kept for liveness and readiness probes: one
    of them may ask ``GET /health`` or ``GET /ready`` (any other request gets the 503), is
    closed after its answer and must send its headers within 2 s, so a socket flood does not
    fail the probes."""
    max_header_count: int = Field(100, gt=0)
    """Request headers accepted; past it a 431."""
    max_header_bytes: int = Field(64 * 1024, gt=0)
    """Request line plus all headers."""
    header_timeout_s: float = Field(10.0, gt=0)
    """From the connection (or the end of the previous response) to the end of the headers."""
    body_timeout_s: float = Field(60.0, gt=0)
    """From the end of the headers to the end of the body."""
    keep_alive_s: float = Field(30.0, gt=0)
    """Idle time after which a keep-alive connection is closed."""
    backlog: int = Field(2048, gt=0)
    """Listen backlog: connections the kernel queues before the server accepts them."""


class DrainConfig(_Strict):
    """Graceful shutdown on SIGTERM (see gateway/api/drain.py)."""

    deadline_s: float = Field(30.0, ge=0)
    """How long requests in flight at SIGTERM may take to finish; past it each remaining stream
    ends with its API's error event (a request not answered yet gets a 503) and the gateway exits.
    While draining, new requests get a 503 ``shutting_down`` with ``Retry-After`` and ``/ready``
    a 503."""


class DiscoveryConfig(_Strict):
    """Engines from a file that the gateway re-reads while it runs (gateway/service/membership.py)."""

    file: str | None = None
    """A YAML or JSON file holding ``pools:`` (the same schema as the ``pools`` key); when set it
    gives the engines at start (instead of ``pools``) and is re-read every ``interval_s`` when its
    modification time changes: engines join and leave without a restart."""
    interval_s: float = Field(5.0, gt=0)
    """How often the discovery file's modification time is checked."""


class HintsConfig(_Strict):
    on_invalid: Literal["reject", "ignore"] = "reject"
    """reject: 400 naming the field; ignore: drop the hints, add an ``x-agentgw-warning`` header."""


class MigrationConfig(_Strict):
    """Inter-turn KV placement through engine_ext's control API (engines with ``control_url``):
    the planner's parameters (:class:`~gateway.core.planner.PlannerParams`: every default is
    its) and the executor's."""

    enabled: bool = True
    control_token: str | None = None
    max_per_engine: int = Field(2, ge=1)
    """Concurrent prefetches per target engine, so migrations never starve live traffic."""
    prefetch_timeout_s: float = Field(120.0, gt=0)
    pin_margin_s: float = Field(_PLANNER.pin_margin_s, ge=0)
    max_pin_s: float = Field(_PLANNER.max_pin_s, gt=0)
    demote_after_s: float = Field(_PLANNER.demote_after_s, gt=0)
    default_gap_s: float = Field(_PLANNER.default_gap_s, ge=0)
    rebalance_queue: int = Field(_PLANNER.rebalance_queue, ge=1)
    max_target_queue: int = Field(_PLANNER.max_target_queue, ge=0)
    kv_bytes_per_token: int = Field(_PLANNER.kv_bytes_per_token, gt=0)
    move_bytes_per_s: float = Field(_PLANNER.move_bytes_per_s, gt=0)
    turn_s: float = Field(_PLANNER.turn_s, gt=0)
    """How long a turn holds its KV (prefill + expected output): the window in which the planner
    counts another session's turn as overlapping the next one (``knee_ahead`` moves: a session
    whose next turn would pass the router's decode knee at home is moved during its tool gap)."""
    copy_margin_s: float = Field(_PLANNER.copy_margin_s, ge=0)
    """A ``knee_ahead`` copy must finish this long before the session's expected return."""
    max_moves_per_engine: int = Field(_PLANNER.max_moves_per_engine, ge=1)
    """``knee_ahead`` moves in flight touching one engine (as source or target)."""
    max_moves_per_s: float = Field(_PLANNER.max_moves_per_s, gt=0)
    """``knee_ahead`` moves started per second (over the last 10 s)."""
    min_dwell_s: float = Field(_PLANNER.min_dwell_s, ge=0)
    """A session is not moved again (``knee_ahead``) within this long of its last move."""

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
    slo: SloConfig = SloConfig()
    routing: RoutingConfig = RoutingConfig()
    sessions: SessionsConfig = SessionsConfig()
    hints: HintsConfig = HintsConfig()
    migration: MigrationConfig = MigrationConfig()
    analysis: AnalysisConfig = AnalysisConfig()
    auth: AuthConfig = AuthConfig()
    admission: AdmissionConfig = AdmissionConfig()
    server: ServerConfig = ServerConfig()
    drain: DrainConfig = DrainConfig()
    discovery: DiscoveryConfig = DiscoveryConfig()

    @model_validator(mode="after")
    def _deprecated_keys(self) -> GatewayConfig:
        if self.routing.interactivity_tok_s is not None:
            msg = "routing.interactivity_tok_s is deprecated: set slo.tok_s"
            if "tok_s" in self.slo.model_fields_set:
                msg += " (slo.tok_s is set and wins)"
            warnings.warn(msg, DeprecationWarning, stacklevel=2)
            log.warning(msg)
        return self

    def slo_tok_s(self) -> float:
        """The decode-speed bound: ``slo.tok_s``, or the deprecated ``routing.interactivity_tok_s``
        where only that is set."""
        old = self.routing.interactivity_tok_s
        return old if old is not None and "tok_s" not in self.slo.model_fields_set else self.slo.tok_s

    @model_validator(mode="after")
    def _unique_names(self) -> GatewayConfig:
        pools = [p.name for p in self.pools]
        if len(pools) != len(set(pools)):
            raise ValueError(f"pool names must be unique, got {pools}")
        engines = [e.name for p in self.pools for e in p.engines]
        if len(engines) != len(set(engines)):
            raise ValueError(f"engine names must be unique across pools, got {engines}")
        return self

    @model_validator(mode="after")
    def _auth_or_loopback(self) -> GatewayConfig:
        a = self.auth
        keyed = a.admin_key_sha256 or a.admin_key_env or any(t.key_sha256 or t.key_env for t in a.tenants)
        if not keyed and not a.allow_unauthenticated and not is_loopback(self.listen.host):
            raise ValueError(
                f"auth: no API keys configured and listen.host {self.listen.host!r} is not loopback "
                "(configure auth.tenants / auth.admin_key_sha256, or set auth.allow_unauthenticated)"
            )
        tenants = [t.name for t in a.tenants]
        if len(tenants) != len(set(tenants)):
            raise ValueError(f"tenant names must be unique, got {tenants}")
        self.session_quotas()  # raises when the tenants' quotas do not fit sessions.capacity
        return self

    def router_params(self) -> RoutingParams:
        """The router's parameters: the ``routing`` section's, with the arrival-time moves priced
        for the planner (:func:`gateway.core.router.with_planner`) where it moves sessions during
        their tool gaps (``migration.enabled`` and an engine with a ``control_url``), for each of
        ``knee_output_tokens`` / ``overflow_wait_tokens`` the configuration does not set."""
        p = dataclasses.replace(
            self.routing.params(), interactivity_tok_s=self.slo_tok_s(), slo_ttft_ms=self.slo.ttft_ms
        )
        if not (self.migration.enabled and any(e.control_url for pl in self.pools for e in pl.engines)):
            return p
        planned, given = with_planner(p), self.routing.model_fields_set
        return dataclasses.replace(
            p,
            knee_output_tokens=p.knee_output_tokens
            if "knee_output_tokens" in given
            else planned.knee_output_tokens,
            overflow_wait_tokens=(
                p.overflow_wait_tokens if "overflow_wait_tokens" in given else planned.overflow_wait_tokens
            ),
        )

    def session_quotas(self) -> dict[str, int]:
        """Each tenant's ``max_sessions`` (unset ones share what the set ones leave of
        ``sessions.capacity`` equally); they sum to at most the capacity, so one tenant's sessions
        never push another's out."""
        tenants = self.auth.tenants
        capacity = self.sessions.capacity
        fixed = sum(t.max_sessions or 0 for t in tenants)
        unset = [t for t in tenants if t.max_sessions is None]
        share = (capacity - fixed) // len(unset) if unset else 0
        if fixed > capacity or (unset and share < 1):
            raise ValueError(
                f"auth.tenants: max_sessions ({fixed} set, {len(unset)} tenant(s) unset) do not fit "
                f"sessions.capacity {capacity}"
            )
        return {t.name: t.max_sessions if t.max_sessions is not None else share for t in tenants}

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


def is_loopback(host: str) -> bool:
    """``127.0.0.0/8``, ``::1`` or ``localhost``."""
    return host == "localhost" or host == "::1" or host.startswith("127.")


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
