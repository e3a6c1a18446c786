"""``interference``: a scorer that prefers the engine where the request's prefill costs least,
counting what it does to the sequences already decoding there.

With the :class:`~gateway.core.policies.cost.EngineCost` model and ``u_e = prompt_tokens -
cached_e`` (the engine's prefix match, any medium):

    c_e = ttft_s(e, u_e) + D_e * prefill_s(u_e)        (own time to first token, including e's
                                                        prefill backlog, plus the pass-time
                                                        increase its chunks inflict on the D_e
                                                        sequences decoding on e)
    score_e = (c_min + eps) / (c_e + eps)              in (0, 1], 1 for the cheapest engine

with ``eps = 1 ms`` so that engines that are all free score alike. A sticky session's home keeps
it through the picker; this scorer decides where new sessions, subagents and re-homed sessions
land in one pool as well as across pools.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from gateway.core.policies.cost import EngineCost
from gateway.core.types import EngineView, RouteRequest, Snapshot

EPS_S = 1e-3


@dataclass(frozen=True, slots=True)
class InterferenceScorer:
    cost: EngineCost
    name: str = "interference"

    def score(self, req: RouteRequest, snap: Snapshot, engines: Sequence[EngineView]) -> Sequence[float]:
        costs = []
        for e in engines:
            m = snap.matches.get(e.name)
            u = req.prompt_tokens - (min(req.prompt_tokens, m.blocks * req.block_size) if m else 0)
            costs.append(self.cost.ttft_s(e, u) + self.cost.interference_s(e, u))
        lo = min(costs, default=0.0)
        return [(lo + EPS_S) / (c + EPS_S) for c in costs]
