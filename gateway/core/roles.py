"""The role controller: how many engines serve as ``first_turn`` and which, from measured load.

Pure decision logic: the caller measures (per engine: prefill backlog tokens, decoding sequences,
KV usage), passes the clock in, and applies the returned role changes to its engine views (the
gateway's service layer on a timer, the simulator in virtual time). The controller keeps only
its own small state: the current roles, when each engine last changed, and a smoothed demand.

Each :meth:`RoleController.step` (at ``now``, with one :class:`EngineLoad` per engine):

1. Demand, in first-turn engines: ``d = B / backlog_tokens_per_engine`` with ``B`` the total
   prefill backlog of all engines, smoothed ``d_s <- d_s + alpha * (d - d_s)``.
2. Hysteresis on the count ``n`` of first-turn engines: one more when ``d_s >= n + 0.5 +
   hysteresis``, one fewer when ``d_s <= n - 0.5 - hysteresis``, kept within ``[min_first_turn,
   max_first_turn]`` and so that at least one engine stays warm.
3. Decode load: no warm engine becomes first-turn if the remaining warm engines' mean KV usage
   would exceed ``warm_kv_high`` (sessions decoding there need the room).
4. Which engine: a warm engine becoming first-turn is the one with the least decode load
   (fewest decoding sequences, then lowest KV usage, then name); a first-turn engine becoming
   warm is the one with the smallest prefill backlog. An engine that changed role less than
   ``min_dwell_s`` ago is not changed again (nor is the change made if no engine may move).

At most one change per step, so the interval between steps bounds the rate of change.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from gateway.core.types import PoolRole

__all__ = ["EngineLoad", "RoleChange", "RoleController", "RoleParams"]


@dataclass(frozen=True, slots=True)
class EngineLoad:
    name: str
    prefill_backlog_tokens: int = 0
    decoding: int = 0
    kv_usage: float = 0.0


@dataclass(frozen=True, slots=True)
class RoleParams:
    backlog_tokens_per_engine: int = 65_536
    """Prefill backlog one first-turn engine is sized for."""
    hysteresis: float = 0.25
    alpha: float = 0.5
    min_first_turn: int = 0
    max_first_turn: int = 1 << 30
    min_dwell_s: float = 30.0
    warm_kv_high: float = 0.8
    interval_s: float = 1.0
    """How often the driver calls :meth:`RoleController.step` (the driver reads it)."""


@dataclass(frozen=True, slots=True)
class RoleChange:
    engine: str
    role: PoolRole
    demand: float
    """The smoothed demand (first-turn engines) that led to the change."""


class RoleController:
    def __init__(self, params: RoleParams, roles: Mapping[str, PoolRole], now: float) -> None:
        if params.backlog_tokens_per_engine <= 0:
            raise ValueError("backlog_tokens_per_engine must be > 0")
        self.params = params
        self.roles: dict[str, PoolRole] = {
            name: (PoolRole.FIRST_TURN if r == PoolRole.FIRST_TURN else PoolRole.WARM)
            for name, r in roles.items()
        }
        self.changed_at: dict[str, float] = dict.fromkeys(self.roles, now - params.min_dwell_s)
        self.demand = float(sum(r == PoolRole.FIRST_TURN for r in self.roles.values()))

    @property
    def first_turn(self) -> int:
        return sum(r == PoolRole.FIRST_TURN for r in self.roles.values())

    def step(self, now: float, loads: Sequence[EngineLoad]) -> tuple[RoleChange, ...]:
        p = self.params
        known = [lo for lo in loads if lo.name in self.roles]
        if not known:
            return ()
        backlog = sum(max(0, lo.prefill_backlog_tokens) for lo in known)
        d = backlog / p.backlog_tokens_per_engine
        self.demand += p.alpha * (d - self.demand)
        n = self.first_turn
        hi = min(p.max_first_turn, len(self.roles) - 1)
        lo_n = min(p.min_first_turn, hi)
        if n < lo_n or (n < hi and self.demand >= n + 0.5 + p.hysteresis):
            return self._grow(now, known)
        if n > hi or (n > lo_n and self.demand <= n - 0.5 - p.hysteresis):
            return self._shrink(now, known)
        return ()

    def _may_move(self, name: str, now: float) -> bool:
        return now - self.changed_at[name] >= self.params.min_dwell_s

    def _apply(self, name: str, role: PoolRole, now: float) -> tuple[RoleChange, ...]:
        self.roles[name] = role
        self.changed_at[name] = now
        return (RoleChange(name, role, self.demand),)

    def _grow(self, now: float, loads: Sequence[EngineLoad]) -> tuple[RoleChange, ...]:
        warm = [lo for lo in loads if self.roles[lo.name] == PoolRole.WARM]
        if len(warm) <= 1:
            return ()
        rest_kv = sum(lo.kv_usage for lo in warm) / (len(warm) - 1)
        if rest_kv > self.params.warm_kv_high:
            return ()
        movable = [lo for lo in warm if self._may_move(lo.name, now)]
        if not movable:
            return ()
        pick = min(movable, key=lambda lo: (lo.decoding, lo.kv_usage, lo.name))
        return self._apply(pick.name, PoolRole.FIRST_TURN, now)

    def _shrink(self, now: float, loads: Sequence[EngineLoad]) -> tuple[RoleChange, ...]:
        first = [
            lo for lo in loads if self.roles[lo.name] == PoolRole.FIRST_TURN and self._may_move(lo.name, now)
        ]
        if not first:
            return ()
        pick = min(first, key=lambda lo: (lo.prefill_backlog_tokens, lo.name))
        return self._apply(pick.name, PoolRole.WARM, now)
