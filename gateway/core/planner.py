"""After a turn completes: where should the session's KV be when its next turn arrives?

``plan_after_turn(turn, engines, matches, params) -> PlanAction``, pure. Rules, first match wins:

1. ``release``: the session ended -> unpin everything it holds.
2. ``replicate``: a main agent's turn announces a fan-out of ``N >= 2`` (a subagent's own requests
   carry the hint too and never replicate) -> prefetch the shared prefix onto the ``N - 1`` best
   other engines, and pin it at home.
3. ``move`` (``first_turn_to_warm``): the turn ran in a ``first_turn`` pool and a warm engine
   exists -> prefetch onto the best warm engine during the tool gap; the next turn goes there.
   Attempted even when the copy may not finish within the gap: the next turn never waits for it,
   and what was copied is not lost (attempting every move beat moving only when the copy fits, in
   the simulator: docs/lab/benchmarks_sim.md).

Targets are warm or ``any`` engines, healthy, queue <= ``max_target_queue``, with room for the
prefix (``unpinned_usage + blocks / capacity_blocks <= 1`` when the capacity is known), ranked by the
prefix already in device memory, then anywhere (medium-weighted), then the least KV in use, the
shortest queue and the name.
4. ``demote``: the expected gap exceeds ``demote_after_s`` -> do not hold device memory for
   it; keep the KV pinned in the host tier / Mooncake for ``gap + pin_margin_s``.
5. ``move`` (``rebalance``): home's queue exceeds ``rebalance_queue``, a target's queue is at most
   half of it, and moving costs less than the gap: ``context_tokens * kv_bytes_per_token /
   move_bytes_per_s < gap``.
6. ``stay``: pin on home for ``min(gap + pin_margin_s, max_pin_s)``.

``plan_turn(turn, engines, matches, params, moves, now, expected)`` runs the same rules with one
more between 3 and 4, and returns the action with the new :class:`MoveState`:

3b. ``move`` (``knee_ahead``): the session's next turn would pass the decode knee at home, so the
   router would move it at arrival and reload its context while the user waits; start the copy
   now, during the tool gap. The projection at the expected return ``now + gap``: the home's
   decode KV then is ``expected[home]`` (the contexts of the other sessions homed there whose turns
   are expected to overlap the return, :meth:`~gateway.core.turn.HomeLedger.expected_at`) plus the
   session's next context ``next_tokens`` (at a target, also the contexts of the moves in flight
   to it); past ``knee_kv_share`` of the home's capacity (the
   cost model's decode knee for the interactivity target), the session moves to the engine where
   the same projection is lowest and under the knee. Whom and when: the copy
   (``(next_tokens - gpu_blocks_there * block_size) * kv_bytes_per_token / move_bytes_per_s``)
   plus ``copy_margin_s`` must fit in the gap (never a turn that is imminent); targets are ranked
   by projected KV share, then by copy seconds per token of KV freed at home (the context the
   target already holds is not copied); a session that passes the knee on its own stays (it is
   slow anywhere). Bounds, in :class:`MoveState`: at most ``max_moves_per_engine`` moves in
   flight touching an engine (as source or target), at most ``max_moves_per_s`` started per
   second over the last ``rate_window_s``, and no move of a session within ``min_dwell_s`` of its
   last one. The session is re-homed only when the copy completes (the executor's rule).

The expected gap is the hinted tool latency, else the session's median observed gap, else
``default_gap_s`` (decided by the caller, passed in ``turn.gap_s``).

``plan_rehome(session, dead, engines, matches, params) -> PlanAction | None``, pure: the session's
home engine is down (ejected). ``move`` (``engine_down``) to the best healthy engine of the dead
engine's pool, ranked like the targets above (queue and room as preferences, not exclusions: the
session needs a home either way); None when the pool has no healthy engine left. The caller
re-homes the session at once and, when it has the session's token ids, prefetches its prefix on
the target from the shared tier (Mooncake) during the gap.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from enum import StrEnum

from gateway.core.types import EngineView, PoolRole, PrefixMatch


class ActionKind(StrEnum):
    STAY = "stay"
    MOVE = "move"
    DEMOTE = "demote"
    REPLICATE = "replicate"
    RELEASE = "release"


@dataclass(frozen=True, slots=True)
class PlannerParams:
    pin_margin_s: float = 5.0
    max_pin_s: float = 600.0
    demote_after_s: float = 120.0
    default_gap_s: float = 10.0
    rebalance_queue: int = 16
    max_target_queue: int = 8
    kv_bytes_per_token: int = 8192
    move_bytes_per_s: float = 2e9
    knee_kv_share: float = 1.0
    """The decode knee as a share of an engine's KV (the router's, for its interactivity target):
    a session whose next turn would pass it at home is moved during its gap (1.0: off)."""
    turn_s: float = 20.0
    """How long a turn holds its KV (prefill + expected output): the overlap window of the
    projection (AgentX-shaped plays in the simulator: 10 s left 1.5x the arrival-time knee moves
    of 20 s)."""
    copy_margin_s: float = 1.0
    """A ``knee_ahead`` copy must finish this long before the expected return."""
    max_moves_per_engine: int = 3
    max_moves_per_s: float = 3.0
    rate_window_s: float = 10.0
    min_dwell_s: float = 60.0
    max_tracked_sessions: int = 4096
    """Bound of :class:`MoveState`'s per-session dwell table (oldest first)."""

    def gap_s(self, hinted_s: float | None, learned_s: float | None) -> float:
        """The tool gap a session is expected to take before its next turn: the hinted one,
        else what its own turns showed (:meth:`SessionRecord.expected_gap`), else
        ``default_gap_s``. The one rule: the service and the simulator both call it."""
        if hinted_s is not None:
            return hinted_s
        return learned_s if learned_s is not None else self.default_gap_s

    def pin_ttl_s(self, gap_s: float) -> float:
        """How long a session's KV stays pinned after a turn: its expected tool gap plus
        ``pin_margin_s``, at most ``max_pin_s``. The one formula: the pin each request carries
        (engine_ext's ``kv_transfer_params``), the planner's actions, the simulator and the
        dashboard all call it."""
        return min(gap_s + self.pin_margin_s, self.max_pin_s)


@dataclass(frozen=True, slots=True)
class TurnOutcome:
    session_id: str
    home: str
    context_tokens: int
    gap_s: float
    fan_out: int = 0
    is_subagent: bool = False
    block_size: int = 128
    ended: bool = False
    next_tokens: int = 0
    """The expected context of the next turn (0: ``context_tokens``)."""


@dataclass(frozen=True, slots=True)
class PlanAction:
    kind: ActionKind
    session_id: str
    source: str
    targets: tuple[str, ...] = ()
    pin_ttl_s: float = 0.0
    reason: str = ""


def _rank(
    engines: Sequence[EngineView],
    matches: dict[str, PrefixMatch],
    turn: TurnOutcome,
    params: PlannerParams,
) -> list[EngineView]:
    blocks = -(-turn.context_tokens // turn.block_size)

    def room(e: EngineView) -> bool:
        return e.capacity_blocks <= 0 or e.unpinned_usage + blocks / e.capacity_blocks <= 1.0

    ok = [
        e
        for e in engines
        if e.healthy
        and e.name != turn.home
        and e.role != PoolRole.FIRST_TURN
        and e.queue <= params.max_target_queue
        and room(e)
    ]
    none = PrefixMatch()
    return sorted(
        ok,
        key=lambda e: (
            -matches.get(e.name, none).gpu_blocks,
            -matches.get(e.name, none).weighted_blocks,
            e.unpinned_usage,
            e.queue,
            e.name,
        ),
    )


def plan_after_turn(
    turn: TurnOutcome,
    engines: Sequence[EngineView],
    matches: dict[str, PrefixMatch],
    params: PlannerParams,
) -> PlanAction:
    home = next((e for e in engines if e.name == turn.home), None)
    pin = params.pin_ttl_s(turn.gap_s)
    move_s = turn.context_tokens * params.kv_bytes_per_token / params.move_bytes_per_s
    sid, src = turn.session_id, turn.home
    if turn.ended:
        return PlanAction(ActionKind.RELEASE, sid, src, reason="session_end")
    if turn.fan_out >= 2 and not turn.is_subagent:
        targets = tuple(e.name for e in _rank(engines, matches, turn, params)[: turn.fan_out - 1])
        if targets:
            return PlanAction(ActionKind.REPLICATE, sid, src, targets, pin, "fan_out")
    if home is not None and home.role == PoolRole.FIRST_TURN:
        ranked = _rank(engines, matches, turn, params)
        if ranked:
            return PlanAction(ActionKind.MOVE, sid, src, (ranked[0].name,), pin, "first_turn_to_warm")
    if turn.gap_s > params.demote_after_s:
        return PlanAction(ActionKind.DEMOTE, sid, src, (), pin, "long_gap")
    if home is not None and home.queue > params.rebalance_queue and move_s < turn.gap_s:
        ranked = [e for e in _rank(engines, matches, turn, params) if e.queue * 2 <= home.queue]
        if ranked:
            return PlanAction(ActionKind.MOVE, sid, src, (ranked[0].name,), pin, "rebalance")
    return PlanAction(ActionKind.STAY, sid, src, (), pin, "stay")


def plan_rehome(
    session_id: str,
    dead: str,
    context_tokens: int,
    block_size: int,
    engines: Sequence[EngineView],
    matches: dict[str, PrefixMatch],
    params: PlannerParams,
    gap_s: float = 0.0,
) -> PlanAction | None:
    pool = next((e.pool for e in engines if e.name == dead), None)
    if pool is None:
        return None
    blocks = -(-context_tokens // block_size)
    none = PrefixMatch()

    def rank(e: EngineView) -> tuple[bool, bool, int, float, float, int, str]:
        m = matches.get(e.name, none)
        fits = e.capacity_blocks <= 0 or e.unpinned_usage + blocks / e.capacity_blocks <= 1.0
        return (
            not fits,
            e.queue > params.max_target_queue,
            -m.gpu_blocks,
            -m.weighted_blocks,
            e.unpinned_usage,
            e.queue,
            e.name,
        )

    live = sorted((e for e in engines if e.healthy and e.pool == pool and e.name != dead), key=rank)
    if not live:
        return None
    pin = params.pin_ttl_s(gap_s)
    return PlanAction(ActionKind.MOVE, session_id, dead, (live[0].name,), pin, "engine_down")


@dataclass(frozen=True, slots=True)
class MoveState:
    """What bounds the planner's moves, passed in and returned (the caller keeps the latest):
    moves in flight per engine (source and target), recent move starts, each session's last move.
    Bounded: ``moved_at`` keeps ``PlannerParams.max_tracked_sessions`` sessions, ``starts`` the
    last ``rate_window_s``."""

    active: Mapping[str, int] = field(default_factory=dict)
    starts: tuple[float, ...] = ()
    moved_at: Mapping[str, float] = field(default_factory=dict)
    inflight: Mapping[str, tuple[str, str, int]] = field(default_factory=dict)
    """session -> (source, target, context tokens) of its move in flight: its KV counts at the
    target in the projection of later moves."""

    def allows(self, session_id: str, source: str, now: float, params: PlannerParams) -> bool:
        if session_id in self.inflight:
            return False
        last = self.moved_at.get(session_id)
        if last is not None and now - last < params.min_dwell_s:
            return False
        recent = sum(1 for t in self.starts if now - t < params.rate_window_s)
        if recent >= params.max_moves_per_s * params.rate_window_s:
            return False
        return self.active.get(source, 0) < params.max_moves_per_engine

    def started(
        self, session_id: str, source: str, target: str, now: float, params: PlannerParams, tokens: int = 0
    ) -> MoveState:
        active = dict(self.active)
        for e in (source, target):
            active[e] = active.get(e, 0) + 1
        moved = {k: v for k, v in self.moved_at.items() if k != session_id}
        moved[session_id] = now
        while len(moved) > params.max_tracked_sessions:
            del moved[next(iter(moved))]
        starts = tuple(t for t in self.starts if now - t < params.rate_window_s) + (now,)
        return MoveState(active, starts, moved, {**self.inflight, session_id: (source, target, tokens)})

    def finished(self, session_id: str) -> MoveState:
        """The session's move completed, failed or was cancelled (no-op when none is in flight)."""
        ends = self.inflight.get(session_id)
        if ends is None:
            return self
        active = dict(self.active)
        for e in ends[:2]:
            n = active.get(e, 0) - 1
            if n > 0:
                active[e] = n
            else:
                active.pop(e, None)
        inflight = {k: v for k, v in self.inflight.items() if k != session_id}
        return MoveState(active, self.starts, self.moved_at, inflight)


def _knee_ahead(
    turn: TurnOutcome,
    engines: Sequence[EngineView],
    matches: dict[str, PrefixMatch],
    params: PlannerParams,
    moves: MoveState,
    now: float,
    expected: Mapping[str, int],
) -> str | None:
    """The target of a ``knee_ahead`` move, or None (see the module docstring, rule 3b)."""
    knee = params.knee_kv_share
    if knee >= 1.0 or turn.gap_s <= 0:
        return None
    home = next((e for e in engines if e.name == turn.home), None)
    if home is None or home.capacity_blocks <= 0:
        return None
    need = turn.next_tokens or turn.context_tokens
    bs = max(1, turn.block_size)

    incoming: dict[str, int] = {}
    for _, target, tokens in moves.inflight.values():
        incoming[target] = incoming.get(target, 0) + tokens

    def share(e: EngineView) -> float:
        return (expected.get(e.name, 0) + incoming.get(e.name, 0) + need) / (e.capacity_blocks * bs)

    if share(home) <= knee or need / (home.capacity_blocks * bs) > knee:
        return None
    if not moves.allows(turn.session_id, home.name, now, params):
        return None
    none = PrefixMatch()
    best: tuple[float, float, str] | None = None
    for e in engines:
        if (
            e.name == home.name
            or not e.healthy
            or e.role == PoolRole.FIRST_TURN
            or e.capacity_blocks <= 0
            or e.queue > params.max_target_queue
            or moves.active.get(e.name, 0) >= params.max_moves_per_engine
        ):
            continue
        u = share(e)
        if u > knee or u >= share(home):
            continue
        held = min(need, matches.get(e.name, none).gpu_blocks * bs)
        copy_s = (need - held) * params.kv_bytes_per_token / params.move_bytes_per_s
        if copy_s + params.copy_margin_s > turn.gap_s:
            continue
        key = (round(u, 6), copy_s / need, e.name)
        if best is None or key < best:
            best = key
    return best[2] if best is not None else None


def plan_turn(
    turn: TurnOutcome,
    engines: Sequence[EngineView],
    matches: dict[str, PrefixMatch],
    params: PlannerParams,
    moves: MoveState,
    now: float,
    expected: Mapping[str, int],
) -> tuple[PlanAction, MoveState]:
    """:func:`plan_after_turn` with the ``knee_ahead`` rule (3b) and its bounds; returns the
    action and the move state to keep (a started ``knee_ahead`` move is in flight in it until
    the caller reports :meth:`MoveState.finished`)."""
    base = plan_after_turn(turn, engines, matches, params)
    if base.kind in (ActionKind.RELEASE, ActionKind.REPLICATE) or base.reason == "first_turn_to_warm":
        return base, moves
    target = _knee_ahead(turn, engines, matches, params, moves, now, expected)
    if target is None:
        return base, moves
    pin = params.pin_ttl_s(turn.gap_s)
    action = PlanAction(ActionKind.MOVE, turn.session_id, turn.home, (target,), pin, "knee_ahead")
    need = turn.next_tokens or turn.context_tokens
    return action, moves.started(turn.session_id, turn.home, target, now, params, need)


def with_knee(params: PlannerParams, knee_kv_share: float) -> PlannerParams:
    """``params`` with the router's decode knee (a share of the KV capacity)."""
    return replace(params, knee_kv_share=knee_kv_share)
