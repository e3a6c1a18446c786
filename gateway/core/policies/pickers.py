"""Pickers: choose one candidate and name the reason.

- ``max_score``: the highest weighted total; ties broken by a stable hash of (session or request
  counter, engine) so equal engines share load deterministically. Reason: the scorer that
  contributed most to the winner (``prefix``, ``queue``, ...).
- ``round_robin``: candidates sorted by name, ``seq mod n``.
- ``session_hash``: rendezvous (highest-random-weight) hashing of the session id over candidates:
  a session sticks to one engine and only 1/n of sessions move when an engine leaves. Requests
  without a session fall back to round-robin.
- ``sticky_bounded(max_queue, prefill_s_per_token, queue_s_per_request, warm_frac, kv_high,
  decode_kv_high)``: ours. Three checks first: a home that holds less than ``warm_frac`` of the
  best prefix match any engine has gives up its claim (the weighted scores decide,
  ``rehome_cold``); a home that cannot hold the turn (``kv_share + ceil(prompt / block) /
  capacity_blocks > kv_high``, capacity known; ``EngineView.kv_share``: the unpinned usage, or
  the gateway's in-flight prompt tokens when more) sends it to the cheapest engine where it fits
  (``kv_overflow``: without this, a sticky home collects sessions it cannot hold and preempts,
  measured in the simulator), unless reloading what that engine lacks takes longer than waiting
  at home for ``overflow_wait_tokens`` decode steps (room frees there as turns end; a 300K-token
  context reloaded at 2.3 GB/s takes 17 s); a home where the turn would push the KV use past
  ``decode_kv_high`` (the cost model's decode knee for the interactivity target,
  :meth:`~gateway.core.policies.cost.EngineCost.decode_knee`: every sequence decoding there would
  fall under it) sends it to the engine with the most room under it (the lowest ``kv_share``;
  then the cheapest: a session moved to the cheapest engine just under the knee passes it again
  next turn and moves again, measured in the simulator) (``kv_balance``), when one
  exists and the move adds at most ``move_max_s`` to the turn's estimated time to first token
  (the estimate below: the uncached tokens the target lacks and its queue; a move that would
  reload a long context costs the turn more TTFT than the decode speed it protects is worth);
  a turn too big to stay under anywhere keeps its home. With a cost model and
  ``knee_output_tokens``, a ``kv_balance`` move is also priced: the decode time it saves over the
  expected output (``knee_output_tokens`` x the step at home beyond the interactivity target's
  step ``slo_step_ms``, less the same at the target, each at its KV share with the turn) must
  exceed the TTFT its reload adds (the context the target
  lacks at ``move_bytes_per_s``, or recomputed): a long context moved at arrival is reloaded
  while the user waits, and the planner's ``knee_ahead`` moves it during the tool gap instead. A cold home is re-scored without its
  ``session_affinity`` bonus (``affinity_weight``, the profile's weight): otherwise a home that
  holds nothing of the prompt outscores an engine that holds most of it. The same two checks apply to a
  request without a home: when the best-scored engine cannot hold it, the cheapest that can
  wins (``kv_overflow``: without it a long turn is placed by its prefix on an engine that
  cannot hold it and preempts itself); when the best-scored engine is past the knee and another is not, the one with the
  most room below wins (``kv_balance``). Then, if the home's queue <= ``max_queue``,
  stay (reason ``sticky``). Otherwise estimate
  each candidate's time to first token as ``uncached_e * prefill_s_per_token + queue_e *
  queue_s_per_request`` with ``uncached_e = prompt_tokens - cached_e`` and leave home only for a
  candidate whose estimate is lower than home's (reason ``sticky_overflow``). A home that the
  filters removed (unhealthy, saturated, or of the other pool role) gives ``rehome``; without a
  home the best weighted total wins (``subagent_parent`` or ``new_session``), except that a new
  session pulled to an engine by the prefix it holds (a shared system prompt and tools) goes to
  the engine with the lowest estimated time to first token (the estimate above, among engines
  where it stays under the knee) when that is lower (``new_session_load``, ``spread_new``):
  the prefix saved is priced against the queue the pull has built (otherwise sessions pile onto
  the one engine that holds the shared system prompt). Every pick carries the turn's predicted
  TTFT and decode speed on the chosen engine (the decision record's predicted SLO outcome); with
  ``slo_ttft_s`` a ``kv_balance`` move is judged by the SLO (``kv_balance_miss``: a deliberate
  TTFT miss within the fleet's budget). What each rule measured: docs/lab/benchmarks_sim.md and
  docs/lab/benchmarks_live.md.
- ``cache_aware(balance_abs, balance_rel, cache_threshold)``: SGLang router's policy. If the
  load is imbalanced (``q_max - q_min > balance_abs`` and ``q_max > balance_rel * q_min``) pick the
  shortest queue (``load``); else if the best prefix match covers more than ``cache_threshold`` of
  the prompt pick it (``prefix``); else pick the engine with the smallest cached footprint, to
  grow the cache where there is room (``cache_room``, approximated by lowest KV usage).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace

from gateway.core.policies.base import Pick, stable_hash
from gateway.core.policies.cost import EngineCost
from gateway.core.types import Candidate, EngineView, RouteRequest, Snapshot

#: The reason a score-based pick reports; the router replaces it with the name of the scorer that
#: separated the winner from the runner-up most (weight x score gap), or ``tie``.
SCORE_REASON = "score"


def _tiebreak_key(req: RouteRequest) -> str:
    return req.session_id or str(req.seq)


@dataclass(frozen=True, slots=True)
class MaxScore:
    name: str = "max_score"

    def pick(self, req: RouteRequest, snap: Snapshot, candidates: Sequence[Candidate]) -> Pick:
        key = _tiebreak_key(req)
        best = max(candidates, key=lambda c: (round(c.total, 9), stable_hash(key + c.engine)))
        return Pick(best, SCORE_REASON if len(candidates) > 1 else "only")


@dataclass(frozen=True, slots=True)
class RoundRobin:
    name: str = "round_robin"

    def pick(self, req: RouteRequest, snap: Snapshot, candidates: Sequence[Candidate]) -> Pick:
        ordered = sorted(candidates, key=lambda c: c.engine)
        return Pick(ordered[req.seq % len(ordered)], "rr")


@dataclass(frozen=True, slots=True)
class SessionHash:
    name: str = "session_hash"

    def pick(self, req: RouteRequest, snap: Snapshot, candidates: Sequence[Candidate]) -> Pick:
        if req.session_id is None:
            return RoundRobin().pick(req, snap, candidates)
        sid = req.session_id
        best = max(candidates, key=lambda c: stable_hash(sid + "\x00" + c.engine))
        return Pick(best, "hash")


def _cached_tokens(req: RouteRequest, snap: Snapshot, engine: str) -> int:
    m = snap.matches.get(engine)
    return min(req.prompt_tokens, m.blocks * req.block_size) if m else 0


def _fits(view: EngineView, req: RouteRequest, kv_high: float) -> bool:
    """Would the whole prompt stay under ``kv_high`` of the engine's KV (capacity known)?"""
    cap = view.capacity_blocks
    blocks = -(-req.prompt_tokens // max(1, req.block_size))
    return cap <= 0 or view.kv_share(req.block_size) + blocks / cap <= kv_high


@dataclass(frozen=True, slots=True)
class StickyBounded:
    max_queue: int
    prefill_s_per_token: float
    queue_s_per_request: float
    warm_frac: float = 0.5
    kv_high: float = 1.0
    decode_kv_high: float = 1.0
    move_max_s: float = float("inf")
    affinity_weight: float = 0.0
    """The ``session_affinity`` scorer's weight in the profile: a home judged cold is re-scored
    without it (0: the totals as scored)."""
    spread_new: bool = True
    """Price a new session's shared-prefix pull against the queue it builds (``new_session_load``)."""
    cost: EngineCost | None = None
    """The engine cost model, to price a ``kv_balance`` move (None: not priced)."""
    knee_output_tokens: int = 0
    """Expected output of a turn: a ``kv_balance`` move is made only when the decode time it saves
    over this many tokens exceeds the TTFT its reload adds (0: not priced)."""
    slo_step_ms: float = 0.0
    """The decode step of the interactivity target (1000 / tok/s): only decode time beyond it
    counts as saved."""
    overflow_wait_tokens: int = 0
    """A ``kv_overflow`` move is made only when its reload takes less than this many decode
    steps at home (0: always)."""
    slo_ttft_s: float = 0.0
    """The TTFT bound of the SLO. When set, a ``kv_balance`` move is judged by the SLO instead of
    ``knee_output_tokens``: one whose predicted TTFT at the target (its queue, the context it
    lacks reloaded or recomputed) meets the bound costs the turn nothing against it and is made;
    one past the bound is a deliberate TTFT miss, made only while the fleet's budget of such
    misses has room (``Snapshot.slo_miss_ok``), reason ``kv_balance_miss``."""
    slo_miss_max_x: float = 0.0
    """A deliberate miss predicted past this multiple of the TTFT bound is not made (0: no cap):
    a turn reloading a long context at arrival would set the TTFT tail."""
    name: str = "sticky_bounded"

    def _cost(self, req: RouteRequest, snap: Snapshot, engine: str) -> float:
        view = next(e for e in snap.engines if e.name == engine)
        uncached = req.prompt_tokens - _cached_tokens(req, snap, engine)
        return uncached * self.prefill_s_per_token + view.queue * self.queue_s_per_request

    def _overflow(
        self,
        req: RouteRequest,
        snap: Snapshot,
        views: dict[str, EngineView],
        natural: Candidate,
        candidates: Sequence[Candidate],
    ) -> Pick | None:
        """``kv_overflow``: the cheapest engine that can hold the turn, when ``natural`` (the
        home, or the best score) cannot; None to keep ``natural``."""
        if _fits(views[natural.engine], req, self.kv_high):
            return None
        room = [c for c in candidates if _fits(views[c.engine], req, self.kv_high)]
        if not room:
            return None
        target = min(room, key=lambda c: (self._cost(req, snap, c.engine), -c.total))
        if not self._worth_leaving(req, snap, views[natural.engine], natural.engine, target.engine):
            return None
        return Pick(target, "kv_overflow")

    def _worth_leaving(self, req: RouteRequest, snap: Snapshot, here: EngineView, stay: str, go: str) -> bool:
        """For ``kv_overflow``: whether reloading the context ``go`` lacks (at ``move_bytes_per_s``)
        takes less than waiting at ``stay`` for ``overflow_wait_tokens`` decode steps (room frees
        as the turns there end). Always, without a cost model or with 0 tokens."""
        cost, wait_tokens = self.cost, self.overflow_wait_tokens
        if cost is None or wait_tokens <= 0:
            return True
        extra = max(0, _cached_tokens(req, snap, stay) - _cached_tokens(req, snap, go))
        reload_s = cost.move_s(extra) if cost.move_bytes_per_s > 0 else cost.prefill_s(extra)
        wait_s = wait_tokens * cost.decode_step_ms(min(1.0, here.kv_share(max(1, req.block_size)))) / 1000.0
        return reload_s < wait_s

    def move_ttft_s(self, req: RouteRequest, snap: Snapshot, view: EngineView, stay: str) -> float:
        """The predicted TTFT of the turn on ``view``'s engine: the prefill backlog ahead of it,
        the context ``stay`` holds and it lacks (reloaded at ``move_bytes_per_s`` or recomputed,
        whichever is faster), and the rest of its uncached prompt prefilled."""
        cost = self.cost
        if cost is None:
            return 0.0
        go_cached = _cached_tokens(req, snap, view.name)
        extra = max(0, _cached_tokens(req, snap, stay) - go_cached)
        rest = max(0, req.prompt_tokens - go_cached - extra)
        reload_s = cost.prefill_s(extra)
        if cost.move_bytes_per_s > 0 and extra > 0:
            reload_s = min(reload_s, cost.move_s(extra))
        return cost.wait_s(view) + reload_s + cost.prefill_s(rest)

    def _verdict(
        self, req: RouteRequest, snap: Snapshot, views: dict[str, EngineView], stay: str, go: str
    ) -> str | None:
        """``kv_balance`` (the move is made), ``kv_balance_miss`` (made as a deliberate TTFT
        miss) or None (not made)."""
        if self.slo_ttft_s <= 0 or self.cost is None:
            return "kv_balance" if self._pays(req, snap, views, stay, go) else None
        ttft = self.move_ttft_s(req, snap, views[go], stay)
        if ttft <= self.slo_ttft_s:
            return "kv_balance"
        if self.slo_miss_max_x > 0 and ttft > self.slo_miss_max_x * self.slo_ttft_s:
            return None
        return "kv_balance_miss" if snap.slo_miss_ok else None

    def _pays(
        self, req: RouteRequest, snap: Snapshot, views: dict[str, EngineView], stay: str, go: str
    ) -> bool:
        """Whether moving the turn from ``stay`` to ``go`` saves more decode time over
        ``knee_output_tokens`` than the TTFT its reload adds. Decode time saved: per token, the
        step at ``stay``'s KV share with the turn beyond the target step ``slo_step_ms``, less
        the same at ``go``. Reload: the context ``go`` lacks and ``stay`` holds, loaded at
        ``move_bytes_per_s`` (recomputed when no tier moves KV: ``move_bytes_per_s`` 0)."""
        cost, out = self.cost, self.knee_output_tokens
        if cost is None or out <= 0:
            return True
        bs = max(1, req.block_size)
        blocks = -(-req.prompt_tokens // bs)

        def u(e: EngineView) -> float:
            return e.kv_share(bs) + (blocks / e.capacity_blocks if e.capacity_blocks > 0 else 0.0)

        slo = self.slo_step_ms

        def late_ms(e: EngineView) -> float:
            return max(0.0, cost.decode_step_ms(u(e)) - slo)

        saved_s = out * (late_ms(views[stay]) - late_ms(views[go])) / 1000.0
        extra = max(0, _cached_tokens(req, snap, stay) - _cached_tokens(req, snap, go))
        reload_s = cost.move_s(extra) if cost.move_bytes_per_s > 0 else cost.prefill_s(extra)
        return reload_s < saved_s

    def _below_knee(
        self,
        req: RouteRequest,
        snap: Snapshot,
        views: dict[str, EngineView],
        natural: Candidate,
        candidates: Sequence[Candidate],
    ) -> Pick | None:
        """``kv_balance``: of the engines where the turn stays under the decode knee within
        ``move_max_s`` of ``natural``'s cost, the one with the most room (then the cheapest),
        when ``natural`` (the home, or the best score) is past it; None to keep ``natural``."""
        if self.decode_kv_high >= self.kv_high or _fits(views[natural.engine], req, self.decode_kv_high):
            return None
        stay = self._cost(req, snap, natural.engine)
        verdicts = {
            c.engine: self._verdict(req, snap, views, natural.engine, c.engine)
            for c in candidates
            if _fits(views[c.engine], req, self.decode_kv_high)
            and self._cost(req, snap, c.engine) - stay <= self.move_max_s
        }
        room = [c for c in candidates if verdicts.get(c.engine) is not None]
        if not room:
            return None
        target = min(
            room,
            key=lambda c: (
                verdicts[c.engine] != "kv_balance",  # a move that meets the TTFT bound first
                views[c.engine].kv_share(req.block_size),
                self._cost(req, snap, c.engine),
                -c.total,
            ),
        )
        reason = verdicts[target.engine]
        assert reason is not None
        return Pick(target, reason)

    def _rescore_cold(self, req: RouteRequest, snap: Snapshot, candidates: Sequence[Candidate]) -> Candidate:
        """The best total once the cold home's ``session_affinity`` bonus is taken out (with it,
        a home holding nothing can outscore an engine holding most of the prompt)."""
        w = self.affinity_weight
        if w == 0:
            return MaxScore().pick(req, snap, candidates).candidate
        key = _tiebreak_key(req)
        return max(
            candidates,
            key=lambda c: (
                round(c.total - w * c.scores.get("session_affinity", 0.0), 9),
                stable_hash(key + c.engine),
            ),
        )

    def _spread_new(
        self, req: RouteRequest, snap: Snapshot, top: Candidate, candidates: Sequence[Candidate]
    ) -> Pick | None:
        """``new_session_load``: a new session (no home, not a subagent following its parent) that
        the scores send to an engine for the prefix it holds (a shared system prompt and tools)
        goes instead to the engine with the lowest estimated time to first token when that one
        is cheaper: the prefix saved is priced against the queue the pull has built. None to
        keep ``top``."""
        if not self.spread_new or req.session_id is None or len(candidates) < 2:
            return None
        top_cached = _cached_tokens(req, snap, top.engine)
        if top_cached <= 0:
            return None
        views = {e.name: e for e in snap.engines}
        high = min(self.kv_high, self.decode_kv_high)
        room = [c for c in candidates if c is top or _fits(views[c.engine], req, high)]
        cost = {c.engine: self._cost(req, snap, c.engine) for c in room}
        best = min(room, key=lambda c: (cost[c.engine], -c.total))
        if cost[best.engine] < cost[top.engine] and _cached_tokens(req, snap, best.engine) < top_cached:
            return Pick(best, "new_session_load")
        return None

    def pick(self, req: RouteRequest, snap: Snapshot, candidates: Sequence[Candidate]) -> Pick:
        p = self._pick(req, snap, candidates)
        cost = self.cost
        if cost is None:
            return p
        view = next(e for e in snap.engines if e.name == p.candidate.engine)
        home = snap.session.home if snap.session else None
        stay = home if home is not None and any(e.name == home for e in snap.engines) else view.name
        bs = max(1, req.block_size)
        u = view.kv_share(bs) + (
            -(-req.prompt_tokens // bs) / view.capacity_blocks if view.capacity_blocks > 0 else 0.0
        )
        tok_s = 1000.0 / cost.decode_step_ms(min(1.0, u), max(1, view.decoding + 1))
        return replace(p, ttft_s=self.move_ttft_s(req, snap, view, stay), tok_s=tok_s)

    def _pick(self, req: RouteRequest, snap: Snapshot, candidates: Sequence[Candidate]) -> Pick:
        home = snap.session.home if snap.session else None
        by_name = {c.engine: c for c in candidates}
        if home is not None and home in by_name:
            views = {e.name: e for e in snap.engines}
            best = max((m.blocks for m in snap.matches.values()), default=0)
            held = snap.matches[home].blocks if home in snap.matches else 0
            if best > 0 and held < self.warm_frac * best:
                return Pick(self._rescore_cold(req, snap, candidates), "rehome_cold")
            overflow = self._overflow(req, snap, views, by_name[home], candidates)
            if overflow is not None:
                return overflow
            balanced = self._below_knee(req, snap, views, by_name[home], candidates)
            if balanced is not None:
                return balanced
            if views[home].queue <= self.max_queue:
                return Pick(by_name[home], "sticky")
            home_cost = self._cost(req, snap, home)
            cheapest = min(candidates, key=lambda c: (self._cost(req, snap, c.engine), -c.total))
            if cheapest.engine != home and self._cost(req, snap, cheapest.engine) < home_cost:
                return Pick(cheapest, "sticky_overflow")
            return Pick(by_name[home], "sticky")
        top = MaxScore().pick(req, snap, candidates)
        if len(candidates) > 1:
            views = {e.name: e for e in snap.engines}
            overflow = self._overflow(req, snap, views, top.candidate, candidates)
            if overflow is not None:
                return overflow
            balanced = self._below_knee(req, snap, views, top.candidate, candidates)
            if balanced is not None:
                return balanced
        if home is not None:
            return Pick(top.candidate, "rehome")
        if req.is_subagent and top.candidate.scores.get("parent_prefix", 0.0) > 0:
            return Pick(top.candidate, "subagent_parent")
        spread = self._spread_new(req, snap, top.candidate, candidates)
        if spread is not None:
            return spread
        if req.session_id is not None and top.reason in (SCORE_REASON, "only"):
            return Pick(top.candidate, "new_session")
        return top


@dataclass(frozen=True, slots=True)
class CacheAware:
    balance_abs: int = 32
    balance_rel: float = 1.5
    cache_threshold: float = 0.5
    name: str = "cache_aware"

    def pick(self, req: RouteRequest, snap: Snapshot, candidates: Sequence[Candidate]) -> Pick:
        views = {e.name: e for e in snap.engines}
        qs = {c.engine: views[c.engine].queue for c in candidates}
        q_min, q_max = min(qs.values()), max(qs.values())
        if q_max - q_min > self.balance_abs and q_max > self.balance_rel * q_min:
            return Pick(min(candidates, key=lambda c: (qs[c.engine], c.engine)), "load")
        best = max(candidates, key=lambda c: (_cached_tokens(req, snap, c.engine), -qs[c.engine]))
        if req.prompt_tokens and _cached_tokens(req, snap, best.engine) > (
            self.cache_threshold * req.prompt_tokens
        ):
            return Pick(best, "prefix")
        room = min(candidates, key=lambda c: (views[c.engine].unpinned_usage, qs[c.engine], c.engine))
        return Pick(room, "cache_room")
