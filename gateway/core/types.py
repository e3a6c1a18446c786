"""Value types shared by the routing core, the service layer and the simulator.

Everything here is plain data: no I/O, no clock, no framework. Time is a float of seconds
passed in by the caller (wall clock in the server, virtual time in the simulator).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import IntEnum, StrEnum


class PoolRole(StrEnum):
    FIRST_TURN = "first_turn"
    WARM = "warm"
    ANY = "any"


class Medium(IntEnum):
    """Where a cached block lives; the value is its weight in prefix scoring (GPU > CPU > STORAGE)."""

    STORAGE = 1
    CPU = 2
    GPU = 3

    @classmethod
    def parse(cls, name: str | None) -> Medium:
        """vLLM publishes ``medium`` as a string ("GPU", "CPU", ...); None means device memory."""
        if not name:
            return cls.GPU
        upper = name.upper()
        if upper in ("GPU", "DEVICE", "HBM", "CUDA"):
            return cls.GPU
        if upper in ("CPU", "HOST", "CPU_PINNED", "DRAM"):
            return cls.CPU
        return cls.STORAGE

    @property
    def weight(self) -> float:
        return {Medium.GPU: 1.0, Medium.CPU: 0.6, Medium.STORAGE: 0.3}[self]


@dataclass(frozen=True, slots=True)
class EngineView:
    """A read-only snapshot of one engine, as the router sees it."""

    name: str
    pool: str
    role: PoolRole
    models: frozenset[str]
    healthy: bool = True
    running: int = 0
    waiting: int = 0
    kv_usage: float = 0.0
    inflight: int = 0
    """Requests the gateway has sent to this engine and not yet finished."""
    capacity_blocks: int = 0
    """Device KV capacity in blocks, when known (0: unknown)."""
    decoding: int = 0
    """Sequences past their prefill, producing tokens (0 when unknown)."""
    prefill_backlog_tokens: int = 0
    """Uncached prompt tokens admitted or queued and not yet computed (0 when unknown)."""
    homed_tokens: int = 0
    """Context tokens of the live sessions the gateway has homed on this engine: the KV their
    next turns will hold while decoding (0 when unknown)."""
    inflight_tokens: int = 0
    """Prompt tokens of the requests the gateway has sent to this engine and not yet finished
    (its load ledger, gateway/core/load.py): the KV they hold or will hold once admitted, known
    before the engine's usage gauge shows it (0 when unknown)."""
    pinned_share: float = 0.0
    """Share of the device KV cache held by engine_ext device soft pins (0 when unknown or no
    pinning scheduler). ``kv_usage`` counts these blocks as used, but a pin yields to a request
    that needs room, so they are free for admission."""

    @property
    def unpinned_usage(self) -> float:
        """``kv_usage`` less the soft-pinned share: the device KV a new request cannot reclaim.
        What every room check and KV ranking reads (pins yield to admission)."""
        return max(0.0, self.kv_usage - self.pinned_share)

    def kv_share(self, block_size: int) -> float:
        """The device KV share a new request cannot reclaim: ``unpinned_usage``, or the
        gateway's in-flight prompt tokens in blocks over the capacity when that is more (they
        lead the scraped gauge). What every room check and KV ranking reads."""
        u = self.unpinned_usage
        if self.inflight_tokens <= 0 or self.capacity_blocks <= 0:
            return u
        return max(u, -(-self.inflight_tokens // max(1, block_size)) / self.capacity_blocks)

    @property
    def queue(self) -> int:
        """Best estimate of outstanding work: engine metrics lag, the gateway's count does not."""
        return max(self.inflight, self.running + self.waiting)


@dataclass(frozen=True, slots=True)
class PrefixMatch:
    """How much of a request's block chain an engine holds, by medium."""

    blocks: int = 0
    """Blocks of the longest cached prefix, any medium."""
    gpu_blocks: int = 0
    """Of those, the leading blocks resident in device memory."""
    weighted_blocks: float = 0.0
    """Sum over matched blocks of the best medium's weight."""


@dataclass(frozen=True, slots=True)
class RouteRequest:
    """What the router needs to know about one request, parsed once by the edge."""

    model: str
    prompt_tokens: int
    """Exact when tokenized, else an estimate from the text length."""
    block_size: int
    session_id: str | None = None
    parent_session_id: str | None = None
    is_subagent: bool = False
    fan_out: int = 0
    interactive: bool = True
    priority: int | None = None
    prefix_key: str | None = None
    """Approximate-prefix fallback key (text) when no tokenizer is configured."""
    seq: int = 0
    """A request counter, for stateless round-robin."""


@dataclass(frozen=True, slots=True)
class SessionView:
    """The router's view of a session's placement."""

    session_id: str
    home: str | None
    pool: str | None
    turns: int
    context_tokens: int
    parent_home: str | None = None


@dataclass(frozen=True, slots=True)
class Snapshot:
    """Everything a routing decision may read: engines, prefix matches, the session."""

    engines: tuple[EngineView, ...]
    matches: dict[str, PrefixMatch] = field(default_factory=dict)
    session: SessionView | None = None
    parent_matches: dict[str, PrefixMatch] = field(default_factory=dict)
    """For a subagent: how much of its parent's last prompt each engine holds."""
    siblings: dict[str, int] = field(default_factory=dict)
    """In-flight requests of the same parent's other subagents, per engine."""
    slo_miss_ok: bool = True
    """Whether the fleet's budget of deliberate TTFT misses has room (:class:`~gateway.core.
    routing.MissBudget`): an arrival-time move whose predicted TTFT is past the SLO may be made
    to keep the decode speed of the turns where it would stay."""


@dataclass(frozen=True, slots=True)
class Candidate:
    engine: str
    pool: str
    total: float
    scores: dict[str, float]


@dataclass(frozen=True, slots=True)
class Decision:
    """The outcome of routing one request, with its explanation."""

    engine: str
    pool: str
    reason: str
    """A short label: sticky, prefix, first_turn, warm, subagent_parent, fanout, load, rr, hash, ..."""
    profile: str
    cached_tokens: int
    uncached_tokens: int
    candidates: tuple[Candidate, ...] = ()
    fallbacks: tuple[str, ...] = ()
    """Other engines of the same pool, best first, for a retry after a connection failure."""
    predicted_ttft_ms: float | None = None
    """The predicted SLO outcome of the decision (None: the profile predicts none): the turn's
    TTFT there, and its decode speed (tokens/s)."""
    predicted_tok_s: float | None = None
