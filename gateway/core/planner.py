"""After a turn completes: where should the session's KV be when its next turn arrives?

``plan_after_turn(turn, engines, matches, params) -> PlanAction``, pure. Rules, first match wins:

1. ``release``: the session ended -> unpin everything it holds.
2. ``replicate``: a main agent's turn announces a fan-out of ``N >= 2`` (a subagent's own requests
   carry the hint too and never replicate) -> prefetch the shared prefix onto the ``N - 1`` best
   other engines, and pin it at home.
3. ``move`` (``first_turn_to_warm``): the turn ran in a ``first_turn`` pool and a warm engine
   exists -> prefetch onto the best warm engine during the tool gap; the next turn goes there.
   Attempted even when the copy may not finish within the gap: the next turn never waits for it,
   and what was copied is not lost (measured in the simulator, 8x64x10 Weka, 2+6 pools: p90 TTFT
   393 ms attempting every move vs 671 ms moving only when the copy fits the gap).

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
    is_subagent: bool = False
    block_size: int = 128
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
    pin = min(turn.gap_s + params.pin_margin_s, params.max_pin_s)
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
    pin = min(gap_s + params.pin_margin_s, params.max_pin_s)
    return PlanAction(ActionKind.MOVE, session_id, dead, (live[0].name,), pin, "engine_down")
