"""Scorers: each maps every candidate engine to a score in [0, 1]; higher is better.

- ``prefix``: ``sum(weight(medium_i) for matched blocks i) / n`` with ``n`` the request's full
  blocks; medium weights GPU 1.0, CPU 0.6, STORAGE 0.3 (precise, from KV events; or approximate,
  from the text index, same formula).
- ``queue``: ``(q_max - q_e) / (q_max - q_min)`` over candidates (1.0 when all equal), with
  ``q = max(gateway in-flight, running + waiting)``: the llm-d queue scorer.
- ``kv_usage``: ``1 - max(0, kv_cache_usage_perc - pinned_share)``: device blocks held only by
  engine_ext soft pins count as used in vLLM's gauge, but a pin yields before vLLM preempts or
  refuses a request, so for the request being placed they are free room (``pinned_share`` 0
  when the engine has no pinning scheduler or its control API is not scraped).
- ``session_affinity``: 1.0 for the session's home engine, else 0.
- ``parent_prefix``: for a subagent, the parent's prefix match fraction on the engine (the
  parent's context is what a subagent's prompt starts with); 1.0 on the parent's home when no
  match is known.
- ``home_load``: ``(h_max - h_e) / (h_max - h_min)`` over candidates (1.0 when all equal), with
  ``h_e`` the context tokens of live sessions homed on the engine: new sessions and subagents
  land where the least decode KV is expected to come back (sticky sessions keep their home
  through the picker), so decoding sequences' KV, which sets the decode step, stays balanced.
- ``spread``: ``1 / (1 + s_e)`` with ``s_e`` the in-flight siblings (same parent) on the engine:
  a fan-out spreads instead of piling onto one engine.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from gateway.core.types import EngineView, RouteRequest, Snapshot


@dataclass(frozen=True, slots=True)
class PrefixScorer:
    name: str = "prefix"

    def score(self, req: RouteRequest, snap: Snapshot, engines: Sequence[EngineView]) -> Sequence[float]:
        n = req.prompt_tokens // req.block_size
        if n <= 0:
            return [0.0] * len(engines)
        out = []
        for e in engines:
            m = snap.matches.get(e.name)
            out.append(min(1.0, m.weighted_blocks / n) if m else 0.0)
        return out


@dataclass(frozen=True, slots=True)
class QueueScorer:
    name: str = "queue"

    def score(self, req: RouteRequest, snap: Snapshot, engines: Sequence[EngineView]) -> Sequence[float]:
        qs = [e.queue for e in engines]
        lo, hi = min(qs, default=0), max(qs, default=0)
        if hi == lo:
            return [1.0] * len(engines)
        return [(hi - q) / (hi - lo) for q in qs]


@dataclass(frozen=True, slots=True)
class KvUsageScorer:
    name: str = "kv_usage"

    def score(self, req: RouteRequest, snap: Snapshot, engines: Sequence[EngineView]) -> Sequence[float]:
        return [min(1.0, max(0.0, 1.0 - e.unpinned_usage)) for e in engines]


@dataclass(frozen=True, slots=True)
class SessionAffinityScorer:
    name: str = "session_affinity"

    def score(self, req: RouteRequest, snap: Snapshot, engines: Sequence[EngineView]) -> Sequence[float]:
        home = snap.session.home if snap.session else None
        return [1.0 if home is not None and e.name == home else 0.0 for e in engines]


@dataclass(frozen=True, slots=True)
class ParentPrefixScorer:
    name: str = "parent_prefix"

    def score(self, req: RouteRequest, snap: Snapshot, engines: Sequence[EngineView]) -> Sequence[float]:
        if not req.is_subagent or snap.session is None:
            return [0.0] * len(engines)
        n = req.prompt_tokens // req.block_size
        parent_home = snap.session.parent_home
        out = []
        for e in engines:
            m = snap.parent_matches.get(e.name)
            if m is not None and n > 0:
                out.append(min(1.0, m.weighted_blocks / n))
            else:
                out.append(1.0 if parent_home is not None and e.name == parent_home else 0.0)
        return out


@dataclass(frozen=True, slots=True)
class SpreadScorer:
    name: str = "spread"

    def score(self, req: RouteRequest, snap: Snapshot, engines: Sequence[EngineView]) -> Sequence[float]:
        return [1.0 / (1.0 + snap.siblings.get(e.name, 0)) for e in engines]


@dataclass(frozen=True, slots=True)
class HomeLoadScorer:
    name: str = "home_load"

    def score(self, req: RouteRequest, snap: Snapshot, engines: Sequence[EngineView]) -> Sequence[float]:
        hs = [e.homed_tokens for e in engines]
        lo, hi = min(hs, default=0), max(hs, default=0)
        if hi == lo:
            return [1.0] * len(engines)
        return [(hi - h) / (hi - lo) for h in hs]
