"""``cost_split``: the work-conserving first-turn / warm split, a filter decided by cost.

The first-turn pool is not a wall: for each request the filter prices serving it on each engine
with the :class:`~gateway.core.policies.cost.EngineCost` model and keeps the role whose cheapest
engine costs least. With ``u_e = prompt_tokens - cached_e`` (the engine's prefix match, any
medium):

    cost_e = ttft_s(e, u_e)                                  own time to first token
           + interference_weight * D_e * prefill_s(u_e)      decoders on e slowed by its chunks
           + move_weight * move_s(prompt_tokens)             only on a ``first_turn`` engine that
                                                             is not the session's home: the
                                                             session's KV moves to a warm engine
                                                             before its next turn (a session
                                                             homed on an engine the controller
                                                             made first-turn owes that move
                                                             wherever this turn runs)

(``D_e`` the sequences decoding on ``e``; ``ttft_s`` includes ``e``'s prefill backlog.) The warm
side is every ``warm`` or ``any`` engine, the first-turn side every ``first_turn`` or ``any``
engine; the filter returns the engines of the cheaper side (ties: warm), so:

- a long fresh prompt goes to an idle first-turn engine rather than stalling the decoders of a
  busy warm one, unless the first-turn pool's backlog costs more than that interference (a burst
  of first turns overflows to warm engines with spare capacity, i.e. few decoders);
- a warm turn stays warm (its uncached tokens are few at home) unless its home is so backed up
  that an idle first-turn engine recomputing the whole prompt plus the move is cheaper.

An engine whose KV cannot hold the prompt (``kv_share + ceil(prompt / block) / capacity_blocks
> kv_high``, capacity known) is priced only if no engine can. With one role present (one pool,
or no engine of the other role left) the filter keeps its input.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from gateway.core.policies.cost import EngineCost
from gateway.core.types import EngineView, PoolRole, RouteRequest, Snapshot


def engine_cost(
    cost: EngineCost,
    req: RouteRequest,
    snap: Snapshot,
    e: EngineView,
    move_weight: float,
    interference_weight: float,
) -> float:
    """``cost_e`` of the formula above (seconds)."""
    m = snap.matches.get(e.name)
    cached = min(req.prompt_tokens, m.blocks * req.block_size) if m else 0
    u = req.prompt_tokens - cached
    c = cost.ttft_s(e, u) + interference_weight * cost.interference_s(e, u)
    home = snap.session.home if snap.session is not None else None
    if e.role == PoolRole.FIRST_TURN and e.name != home:
        c += move_weight * cost.move_s(req.prompt_tokens)
    return c


@dataclass(frozen=True, slots=True)
class CostSplit:
    cost: EngineCost
    move_weight: float = 0.5
    interference_weight: float = 1.0
    kv_high: float = 1.0
    name: str = "pool_role"

    def filter(
        self, req: RouteRequest, snap: Snapshot, engines: Sequence[EngineView]
    ) -> Sequence[EngineView]:
        first = [e for e in engines if e.role in (PoolRole.FIRST_TURN, PoolRole.ANY)]
        warm = [e for e in engines if e.role in (PoolRole.WARM, PoolRole.ANY)]
        if not any(e.role == PoolRole.FIRST_TURN for e in first) or not any(
            e.role == PoolRole.WARM for e in warm
        ):
            return engines
        blocks = -(-req.prompt_tokens // max(1, req.block_size))

        def fits(e: EngineView) -> bool:
            return (
                e.capacity_blocks <= 0
                or e.kv_share(req.block_size) + blocks / e.capacity_blocks <= self.kv_high
            )

        priced = {e.name for e in engines if fits(e)} or {e.name for e in engines}

        def best(side: Sequence[EngineView]) -> float:
            return min(
                (
                    engine_cost(self.cost, req, snap, e, self.move_weight, self.interference_weight)
                    for e in side
                    if e.name in priced
                ),
                default=float("inf"),
            )

        return first if best(first) < best(warm) else warm
