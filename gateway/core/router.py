"""route(request, snapshot) -> Decision: filters, then weighted scorers, then a picker.

Profiles are built by name from :class:`RoutingParams` (see ``PROFILES``). The router is
immutable and pure: the same request and snapshot always give the same decision.

Profiles:
- ``agentic`` (ours): healthy, model, pool_role, saturation -> prefix, session_affinity,
  parent_prefix, spread, queue, kv_usage, home_load (0 unless configured: the home ledger feeds it),
  interference (0 unless set) -> sticky_bounded (with the decode knee of
  ``interactivity_tok_s``: ``kv_balance``). ``pool_role`` is the work-conserving
  ``cost_split`` (``split="cost"``: first-turn vs warm priced with the engine cost model in the
  ``cost_*`` parameters, the default) or the fixed threshold on estimated uncached tokens
  (``split="wall"``: ``first_turn_threshold_tokens``).
- ``precise_prefix`` (llm-d style): healthy, model -> prefix (precise, from KV events) x2,
  queue, kv_usage -> max_score.
- ``cache_aware`` (SGLang router style): healthy, model -> (approximate text prefix index) ->
  cache_aware picker.
- ``least_loaded``: healthy, model -> queue -> max_score.
- ``round_robin``: healthy, model -> round_robin.
- ``session_hash``: healthy, model -> rendezvous hash of the session id.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace

from gateway.core.policies.base import Picker, Profile, Weighted
from gateway.core.policies.cost import EngineCost
from gateway.core.policies.filters import Healthy, PoolByUncached, Saturation, ServesModel
from gateway.core.policies.interference import InterferenceScorer
from gateway.core.policies.pickers import (
    SCORE_REASON,
    CacheAware,
    MaxScore,
    RoundRobin,
    SessionHash,
    StickyBounded,
)
from gateway.core.policies.scorers import (
    HomeLoadScorer,
    KvUsageScorer,
    ParentPrefixScorer,
    PrefixScorer,
    QueueScorer,
    SessionAffinityScorer,
    SpreadScorer,
)
from gateway.core.policies.split import CostSplit
from gateway.core.types import Candidate, Decision, EngineView, RouteRequest, Snapshot

DEFAULT_WEIGHTS: dict[str, float] = {
    "prefix": 3.0,
    "session_affinity": 2.0,
    "parent_prefix": 1.5,
    "spread": 1.0,
    "queue": 1.0,
    "kv_usage": 0.5,
    "interference": 0.0,
    "home_load": 0.0,
}
"""Scorer weights of the ``agentic`` profile; a weight left out of ``RoutingParams.weights``
takes its default from here. ``interference`` and ``home_load`` are opt-in (0): ``home_load``
also sends subagents and new sessions away from a cached parent prefix, which a small fleet then
recomputes."""


@dataclass(frozen=True, slots=True)
class RoutingParams:
    profile: str = "agentic"
    first_turn_threshold_tokens: int = 4096
    sticky_max_queue: int = 16
    saturation_max_queue: int = 64
    interactivity_tok_s: float = 50.0
    """The decode speed the ``agentic`` picker protects (AgentX's P90 interactivity SLO): a turn
    leaves its home (or best-scored engine) when its KV there would pass the cost model's decode
    knee for this rate (``EngineCost.decode_knee``: u = 0.31 for the default step polynomial at
    50 tok/s) and another engine stays under it (reason ``kv_balance``). 0: off (only the fit
    check at a full cache)."""
    knee_move_max_s: float = 0.0
    """The most a ``kv_balance`` move may add to the turn's estimated time to first token (the
    target's uncached tokens x ``prefill_s_per_token`` + its queue x ``queue_s_per_request``,
    against the home's), for fleets where TTFT matters more than decode speed. 0: any move."""
    knee_output_tokens: int = 0
    """A ``kv_balance`` move is made only when the decode time it saves over this many output
    tokens (the decode step beyond ``1000 / interactivity_tok_s`` ms, at home less at the target)
    exceeds the TTFT its reload adds (from the cost model: the context the target lacks at
    ``move_bytes_per_s``); 0: any move under ``knee_move_max_s``. Set it far below a typical
    output when the planner moves sessions during their tool gaps (``knee_ahead``): the turns
    still past the knee at arrival are the ones it could not move, and reloading them while the
    user waits sets the TTFT tail."""
    overflow_wait_tokens: int = 0
    """A ``kv_overflow`` move (the home cannot hold the turn) is made only when reloading what the
    target lacks (at ``move_bytes_per_s``) takes less than this many decode steps at home: the
    wait for room to free there, about half of AgentX's median output. 0: always move."""
    prefill_s_per_token: float = 2e-5
    queue_s_per_request: float = 0.05
    slo_ttft_ms: float = 1000.0
    """The SLO's TTFT bound (the decision record's predicted misses; with ``slo_moves``, the
    bound arrival-time moves are judged by)."""
    slo_moves: bool = False
    """Judge an arrival-time ``kv_balance`` move by the SLO (:attr:`StickyBounded.slo_ttft_s`)
    instead of ``knee_output_tokens``. Off: measured, it does not yet win both the Weka and the
    AgentX-shaped plays (docs/lab/benchmarks_sim.md, "Arrival moves judged by the SLO")."""
    slo_miss_budget: float = 0.0
    """The share of turns the router may send past the TTFT bound on purpose (a ``kv_balance``
    move whose reload takes longer) to keep decode speed where they would have stayed, counted
    over the last ``slo_miss_window`` routed turns (:class:`~gateway.core.routing.MissBudget`)."""
    slo_miss_window: int = 1000
    slo_miss_reach: float = 1.0
    """Deliberate misses are made only while at most this share of the last finished turns
    decoded under ``interactivity_tok_s`` (:meth:`~gateway.core.routing.RoutingCore.observe`):
    past it the tok/s tail is lost whatever moves, and a TTFT miss buys nothing."""
    slo_miss_max_x: float = 0.0
    """A deliberate miss predicted past this multiple of ``slo_ttft_ms`` is not made (0: no cap)."""
    cold_home_no_affinity: bool = True
    """A home judged cold (``rehome_cold``) is re-scored without its ``session_affinity`` bonus."""
    new_session_load: bool = True
    """A new session's shared-prefix pull is priced against the queue it builds
    (``new_session_load``): it goes where its estimated time to first token is lowest."""
    split: str = "cost"
    """``cost``: work-conserving first-turn / warm split (policies/split.py); ``wall``: the
    fixed ``first_turn_threshold_tokens`` filter. ``cost`` reads the engine views' ``decoding``
    and ``prefill_backlog_tokens`` (the gateway's load ledger, gateway/core/load.py, fills them
    in the service; the simulator from its ledger or its engine model)."""
    cost_prefill_ms: tuple[float, float, float] = EngineCost().prefill_ms
    cost_chunk_tokens: int = EngineCost().chunk_tokens
    cost_decode_ms: tuple[float, float, float] = EngineCost().decode_ms
    cost_decode_seq_ms: float = EngineCost().decode_seq_ms
    """Decode step per decoding sequence (ms); 0 (the mocker) unless the engines' step grows
    with the batch (the H200 AIC fit: 0.0846)."""
    cost_decode_kv_ms_per_mtok: float = EngineCost().decode_kv_ms_per_mtok
    """Decode step per million context tokens the batch reads (ms; the H200 AIC fit: 42.15),
    with the context approximated as the KV use times ``cost_kv_capacity_tokens``."""
    cost_kv_capacity_tokens: int = EngineCost().kv_capacity_tokens
    """One engine's KV capacity in tokens (0: unknown, the context term is left out)."""
    cost_decode_seq_tokens: int = EngineCost().decode_seq_tokens
    """A typical decoding sequence's context, to estimate the batch at the knee (0: one)."""
    kv_bytes_per_token: int = EngineCost().kv_bytes_per_token
    move_bytes_per_s: float = EngineCost().move_bytes_per_s
    split_move_weight: float = 0.5
    split_interference_weight: float = 1.0
    weights: dict[str, float] = field(default_factory=lambda: dict(DEFAULT_WEIGHTS))
    """Scorer weights of the ``agentic`` profile (missing ones: :data:`DEFAULT_WEIGHTS`)."""


PLANNED_KNEE_OUTPUT_TOKENS = 30
"""``knee_output_tokens`` where the planner moves sessions during their tool gaps."""
PLANNED_OVERFLOW_WAIT_TOKENS = 222
"""``overflow_wait_tokens`` where the planner moves sessions during their tool gaps."""


def with_planner(p: RoutingParams) -> RoutingParams:
    """The router's parameters where the planner moves sessions during their tool gaps
    (``knee_ahead``): the arrival-time ``kv_balance`` and ``kv_overflow`` moves priced against
    their reload (``PLANNED_KNEE_OUTPUT_TOKENS``, ``PLANNED_OVERFLOW_WAIT_TOKENS``), where
    ``p`` leaves them unpriced (0). The turns still past the knee at arrival are then the ones
    the planner could not move, and reloading them while the user waits sets the TTFT tail
    (docs/benchmarks_sim.md, "AgentX-shaped plays: moving KV during the tool gap")."""
    return replace(
        p,
        knee_output_tokens=p.knee_output_tokens or PLANNED_KNEE_OUTPUT_TOKENS,
        overflow_wait_tokens=p.overflow_wait_tokens or PLANNED_OVERFLOW_WAIT_TOKENS,
    )


def _w(p: RoutingParams, name: str) -> float:
    return p.weights.get(name, DEFAULT_WEIGHTS[name])


def engine_cost(p: RoutingParams) -> EngineCost:
    """The cost model the ``cost_split`` filter prices with."""
    return EngineCost(
        prefill_ms=p.cost_prefill_ms,
        chunk_tokens=p.cost_chunk_tokens,
        decode_ms=p.cost_decode_ms,
        kv_bytes_per_token=p.kv_bytes_per_token,
        decode_seq_ms=p.cost_decode_seq_ms,
        decode_kv_ms_per_mtok=p.cost_decode_kv_ms_per_mtok,
        kv_capacity_tokens=p.cost_kv_capacity_tokens,
        decode_seq_tokens=p.cost_decode_seq_tokens,
        move_bytes_per_s=p.move_bytes_per_s,
    )


def _pool_role(p: RoutingParams) -> CostSplit | PoolByUncached:
    if p.split == "cost":
        return CostSplit(engine_cost(p), p.split_move_weight, p.split_interference_weight)
    if p.split == "wall":
        return PoolByUncached(p.first_turn_threshold_tokens)
    raise ValueError(f"unknown split {p.split!r}; choose 'cost' or 'wall'")


def _agentic(p: RoutingParams) -> Profile:
    return Profile(
        "agentic",
        (Healthy(), ServesModel(), _pool_role(p), Saturation(p.saturation_max_queue)),
        (
            Weighted(PrefixScorer(), _w(p, "prefix")),
            Weighted(SessionAffinityScorer(), _w(p, "session_affinity")),
            Weighted(ParentPrefixScorer(), _w(p, "parent_prefix")),
            Weighted(SpreadScorer(), _w(p, "spread")),
            Weighted(QueueScorer(), _w(p, "queue")),
            Weighted(KvUsageScorer(), _w(p, "kv_usage")),
            Weighted(InterferenceScorer(engine_cost(p)), _w(p, "interference")),
            Weighted(HomeLoadScorer(), _w(p, "home_load")),
        ),
        StickyBounded(
            p.sticky_max_queue,
            p.prefill_s_per_token,
            p.queue_s_per_request,
            decode_kv_high=engine_cost(p).decode_knee(p.interactivity_tok_s),
            move_max_s=p.knee_move_max_s or float("inf"),
            affinity_weight=_w(p, "session_affinity") if p.cold_home_no_affinity else 0.0,
            spread_new=p.new_session_load,
            cost=engine_cost(p),
            knee_output_tokens=p.knee_output_tokens,
            slo_step_ms=1000.0 / p.interactivity_tok_s if p.interactivity_tok_s > 0 else 0.0,
            overflow_wait_tokens=p.overflow_wait_tokens,
            slo_ttft_s=p.slo_ttft_ms / 1000.0 if p.slo_moves else 0.0,
            slo_miss_max_x=p.slo_miss_max_x,
        ),
    )


def _precise_prefix(p: RoutingParams) -> Profile:
    return Profile(
        "precise_prefix",
        (Healthy(), ServesModel()),
        (Weighted(PrefixScorer(), 2.0), Weighted(QueueScorer(), 1.0), Weighted(KvUsageScorer(), 1.0)),
        MaxScore(),
    )


def _simple(
    name: str, picker: Picker, scorers: tuple[Weighted, ...] = ()
) -> Callable[[RoutingParams], Profile]:
    def build(p: RoutingParams) -> Profile:
        return Profile(name, (Healthy(), ServesModel()), scorers, picker)

    return build


PROFILES: dict[str, Callable[[RoutingParams], Profile]] = {
    "agentic": _agentic,
    "precise_prefix": _precise_prefix,
    "cache_aware": _simple("cache_aware", CacheAware()),
    "least_loaded": _simple("least_loaded", MaxScore(), (Weighted(QueueScorer(), 1.0),)),
    "round_robin": _simple("round_robin", RoundRobin()),
    "session_hash": _simple("session_hash", SessionHash()),
}


class NoEngine(Exception):
    """No engine can take the request; ``reason`` is ``unknown_model`` or ``unavailable``."""

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason = reason


class Router:
    def __init__(self, params: RoutingParams) -> None:
        if params.profile not in PROFILES:
            raise ValueError(f"unknown routing profile {params.profile!r}; choose one of {sorted(PROFILES)}")
        self.params = params
        self.profile = PROFILES[params.profile](params)

    def route(self, req: RouteRequest, snap: Snapshot) -> Decision:
        engines: Sequence[EngineView] = snap.engines
        for f in self.profile.filters:
            before = engines
            engines = f.filter(req, snap, engines)
            if not engines:
                if f.name == "model" and not any(req.model in e.models for e in snap.engines):
                    raise NoEngine("unknown_model", f"model '{req.model}' is not served by any pool")
                if f.name in ("healthy", "model"):
                    raise NoEngine("unavailable", f"no healthy engine serves model '{req.model}'")
                engines = before
        candidates = self._score(req, snap, engines)
        pick = self.profile.picker.pick(req, snap, candidates)
        chosen = pick.candidate
        reason = self._explain(chosen, candidates) if pick.reason == SCORE_REASON else pick.reason
        match = snap.matches.get(chosen.engine)
        cached = min(req.prompt_tokens, match.blocks * req.block_size) if match else 0
        same_pool = sorted(
            (c for c in candidates if c.engine != chosen.engine and c.pool == chosen.pool),
            key=lambda c: -c.total,
        )
        return Decision(
            engine=chosen.engine,
            pool=chosen.pool,
            reason=reason,
            profile=self.profile.name,
            cached_tokens=cached,
            uncached_tokens=req.prompt_tokens - cached,
            candidates=tuple(candidates),
            fallbacks=tuple(c.engine for c in same_pool),
            predicted_ttft_ms=None if pick.ttft_s is None else round(pick.ttft_s * 1000.0, 3),
            predicted_tok_s=None if pick.tok_s is None else round(pick.tok_s, 3),
        )

    def _explain(self, chosen: Candidate, candidates: Sequence[Candidate]) -> str:
        """The scorer that separated the winner from the runner-up most (weight x score gap)."""
        runner_up = max((c for c in candidates if c is not chosen), key=lambda c: c.total, default=None)
        if runner_up is None:
            return "only"
        best_name, best_gap = "tie", 1e-9
        for w in self.profile.scorers:
            name = w.scorer.name
            gap = w.weight * (chosen.scores.get(name, 0.0) - runner_up.scores.get(name, 0.0))
            if gap > best_gap:
                best_name, best_gap = name, gap
        return best_name

    def _score(self, req: RouteRequest, snap: Snapshot, engines: Sequence[EngineView]) -> list[Candidate]:
        per_scorer = [(w, w.scorer.score(req, snap, engines)) for w in self.profile.scorers if w.weight]
        out = []
        for i, e in enumerate(engines):
            scores = {w.scorer.name: s[i] for w, s in per_scorer}
            total = sum(w.weight * s[i] for w, s in per_scorer)
            out.append(Candidate(e.name, e.pool, total, scores))
        return out
