"""Filters: each narrows the list of engines a request may go to.

- ``healthy``: engines whose health probe passes.
- ``model``: engines that serve the requested model.
- ``pool_role(threshold)``: the first-turn / warm split keyed on the tokens a *warm* engine would
  have to compute, ``u = prompt_tokens - max_{e warm or any} cached_e`` (best prefix match among
  the warm side's engines, any medium): ``u >= threshold`` -> engines of ``first_turn`` pools, else
  engines of ``warm`` pools; engines of ``any`` pools are always kept. So a session whose KV lives
  only on its first-turn home stays there until the planner moves it to a warm engine (then
  ``u`` is small): sending it warm without its KV would recompute the whole prefix. If the preferred role has no engine left, the other role is used,
  so a request is never refused for lack of a role.
- ``saturation(max_queue)``: drop engines whose queue exceeds ``max_queue`` unless that would drop
  them all.

Filters that would leave nothing keep their input (except ``healthy`` and ``model``, whose
emptiness the router reports as an error).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from gateway.core.types import EngineView, PoolRole, RouteRequest, Snapshot


@dataclass(frozen=True, slots=True)
class Healthy:
    name: str = "healthy"

    def filter(
        self, req: RouteRequest, snap: Snapshot, engines: Sequence[EngineView]
    ) -> Sequence[EngineView]:
        return [e for e in engines if e.healthy]


@dataclass(frozen=True, slots=True)
class ServesModel:
    name: str = "model"

    def filter(
        self, req: RouteRequest, snap: Snapshot, engines: Sequence[EngineView]
    ) -> Sequence[EngineView]:
        return [e for e in engines if req.model in e.models]


def estimated_uncached(req: RouteRequest, snap: Snapshot) -> int:
    best = max((m.blocks for m in snap.matches.values()), default=0)
    return max(0, req.prompt_tokens - best * req.block_size)


def _warm_side(snap: Snapshot, engine: str) -> bool:
    return any(e.name == engine and e.role != PoolRole.FIRST_TURN for e in snap.engines)


@dataclass(frozen=True, slots=True)
class PoolByUncached:
    threshold_tokens: int
    name: str = "pool_role"

    def filter(
        self, req: RouteRequest, snap: Snapshot, engines: Sequence[EngineView]
    ) -> Sequence[EngineView]:
        best = max(
            (m.blocks for name, m in snap.matches.items() if _warm_side(snap, name)),
            default=0,
        )
        fresh = max(0, req.prompt_tokens - best * req.block_size) >= self.threshold_tokens
        want = PoolRole.FIRST_TURN if fresh else PoolRole.WARM
        chosen = [e for e in engines if e.role in (want, PoolRole.ANY)]
        if any(e.role == want for e in chosen):
            return chosen
        return engines


@dataclass(frozen=True, slots=True)
class Saturation:
    max_queue: int
    name: str = "saturation"

    def filter(
        self, req: RouteRequest, snap: Snapshot, engines: Sequence[EngineView]
    ) -> Sequence[EngineView]:
        kept = [e for e in engines if e.queue <= self.max_queue]
        return kept or engines
