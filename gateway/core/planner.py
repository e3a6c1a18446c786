"""After a turn completes: where should the session's KV be when its next turn arrives?

``plan_after_turn(turn, engines, matches, params) -> PlanAction``, pure. Rules, first match wins:

1. ``release``: the session ended -> unpin everything it holds.
2. ``replicate``: a fan-out of ``N >= 2`` is announced -> prefetch the shared prefix onto the
   ``N - 1`` best other engines (warm or ``any`` role, healthy, queue <= ``max_target_queue``;
   best = most prefix already held, then shortest queue), and pin it at home.
3. ``move`` (``first_turn_to_warm``): the turn ran in a ``first_turn`` pool and a warm engine
   exists -> prefetch onto the best warm engine during the tool gap; the next turn goes there.
4. ``demote``: the expected gap exceeds ``demote_after_s`` -> do not hold device memory for
   it; keep the KV pinned in the host tier / Mooncake for ``gap + pin_margin_s``.
5. ``move`` (``rebalance``): home's queue exceeds ``rebalance_queue``, a target's queue is at most
   half of it, and moving costs less than the gap: ``context_tokens * kv_bytes_per_token /
   move_bytes_per_s < gap``.
6. ``stay``: pin on home for ``min(gap + pin_margin_s, max_pin_s)``.

The expected gap is the hinted tool latency, else the session's median observed gap, else
``default_gap_s`` (decided by the caller, passed in ``turn.gap_s``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
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


@dataclass(frozen=True, slots=True)
class TurnOutcome:
    session_id: str
    home: str
    context_tokens: int
    gap_s: float
    fan_out: int = 0
    ended: bool = False


@dataclass(frozen=True, slots=True)
class PlanAction:
    kind: ActionKind
    session_id: str
    source: str
    targets: tuple[str, ...] = ()
    pin_ttl_s: float = 0.0
    reason: str = ""


def _rank(
    engines: Sequence[EngineView], matches: dict[str, PrefixMatch], exclude: str, params: PlannerParams
) -> list[EngineView]:
    ok = [
        e
        for e in engines
        if e.healthy
        and e.name != exclude
        and e.role != PoolRole.FIRST_TURN
        and e.queue <= params.max_target_queue
    ]
    return sorted(ok, key=lambda e: (-(matches[e.name].blocks if e.name in matches else 0), e.queue, e.name))


def plan_after_turn(
    turn: TurnOutcome,
    engines: Sequence[EngineView],
    matches: dict[str, PrefixMatch],
    params: PlannerParams,
) -> PlanAction:
    home = next((e for e in engines if e.name == turn.home), None)
    pin = min(turn.gap_s + params.pin_margin_s, params.max_pin_s)
    if turn.ended:
        return PlanAction(ActionKind.RELEASE, turn.session_id, turn.home, reason="session_end")
    if turn.fan_out >= 2:
        targets = tuple(e.name for e in _rank(engines, matches, turn.home, params)[: turn.fan_out - 1])
        if targets:
            return PlanAction(ActionKind.REPLICATE, turn.session_id, turn.home, targets, pin, "fan_out")
    if home is not None and home.role == PoolRole.FIRST_TURN:
        ranked = _rank(engines, matches, turn.home, params)
        if ranked:
            return PlanAction(
                ActionKind.MOVE, turn.session_id, turn.home, (ranked[0].name,), pin, "first_turn_to_warm"
            )
    if turn.gap_s > params.demote_after_s:
        return PlanAction(ActionKind.DEMOTE, turn.session_id, turn.home, (), pin, "long_gap")
    if home is not None and home.queue > params.rebalance_queue:
        move_s = turn.context_tokens * params.kv_bytes_per_token / params.move_bytes_per_s
        ranked = [e for e in _rank(engines, matches, turn.home, params) if e.queue * 2 <= home.queue]
        if ranked and move_s < turn.gap_s:
            return PlanAction(
                ActionKind.MOVE, turn.session_id, turn.home, (ranked[0].name,), pin, "rebalance"
            )
    return PlanAction(ActionKind.STAY, turn.session_id, turn.home, (), pin, "stay")
