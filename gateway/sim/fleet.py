"""The fleet, by simulation: R gateway replicas in front of many engines, each replica with its own
view, as they run live (docs/operations.md, "Several gateway replicas on one Redis").

:class:`FleetSimulator` is :class:`gateway.sim.cluster.Simulator` with ``R`` routing cores
(:class:`gateway.core.routing.RoutingCore`, the object each gateway replica drives) instead of one:

- **its own prefix index**, fed by the engines' KV events after ``event_delay_s``; each event
  batch is lost for a replica with probability ``event_loss``, and as in
  ``gateway/service/kv_events.py`` the replica sees the gap at that engine's next batch and
  clears the engine's entries (they refill from new events). ``index``: ``exact`` (the core's
  :class:`~gateway.core.prefix_index.PrefixIndex`), ``tables`` or ``bloom``
  (:mod:`gateway.core.prefix_tables`);
- **its own load view**: the engines' gauges (running, waiting, KV use) as scraped every
  ``scrape_s``, and its own in-flight ledger (:class:`gateway.core.load.InflightLoad`) for what it
  sent itself (``shared_load``: every replica's ledger, as if they shared them); its own home
  ledger and sibling counts (in the core);
- **a shared session store** with a latency: a record written at ``t`` is visible to every
  replica from ``t + store_latency_s``; each request's time to first token also pays the two
  round trips a live replica makes before forwarding (read, then write the placement).

Clients spread at random: each request goes to a replica drawn uniformly (seeded RNG), so a
session's turns cross replicas as behind a round-robin balancer. Decision cost is the wall time
of ``on_arrival`` + ``decide`` per request on each replica; index memory is the entries each
replica holds times bytes per entry measured with ``tracemalloc`` for that index class.
"""

from __future__ import annotations

import random
import time
import tracemalloc
from collections import deque
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, replace

from gateway.core.load import EngineCounts, InflightLoad, merge
from gateway.core.prefix_index import PrefixIndex
from gateway.core.prefix_tables import BloomTables, EngineTables
from gateway.core.routing import Arrival, RoutingCore, Write
from gateway.core.sessions import SessionRecord
from gateway.core.turn import IndexKind, Turn
from gateway.core.types import Decision, EngineView
from gateway.sim.cluster import SimConfig, Simulator
from gateway.sim.engine import Seq
from gateway.sim.traces import Play

__all__ = ["FleetConfig", "FleetSimulator", "bytes_per_entry", "replicate_plays"]


@dataclass(frozen=True, slots=True)
class FleetConfig:
    replicas: int = 1
    event_delay_s: float = 0.0
    event_loss: float = 0.0
    store_latency_s: float = 0.001
    scrape_s: float = 1.0
    index: str = "exact"
    """``exact`` | ``tables`` | ``bloom``."""
    seed: int = 0
    on_gap: str = "clear"
    """What a replica does when it finds a lost batch: ``clear`` the engine's entries (what
    gateway/service/kv_events.py does) or ``keep`` them (what the lost batch said is missed)."""
    shared_load: bool = False
    """Every replica sees every replica's in-flight ledger (as if they shared it at once), not
    only its own: what sharing the ledgers would buy."""


def replicate_plays(plays: Sequence[Play], copies: int) -> list[Play]:
    """``copies`` copies of ``plays``; copy ``c`` adds ``c * (max hash + 1)`` to every block hash,
    so copies share no block with each other (within a copy, plays share what they shared) and
    its play ids get a ``~c`` suffix."""
    if copies <= 1:
        return list(plays)
    off = max((h for p in plays for r in p.requests for h in r.hashes), default=0) + 1
    out = []
    for c in range(copies):
        for p in plays:
            reqs = [replace(r, hashes=[h + c * off for h in r.hashes]) for r in p.requests]
            out.append(replace(p, play_id=f"{p.play_id}~{c}", requests=reqs))
    return out


def _new_index(kind: str, cap: int, engine_blocks: int) -> PrefixIndex | EngineTables | BloomTables:
    if kind == "exact":
        return PrefixIndex(cap)
    if kind == "tables":
        return EngineTables(cap)
    if kind == "bloom":
        return BloomTables(engine_blocks)
    raise ValueError(f"unknown index {kind!r}; choose exact, tables or bloom")


def bytes_per_entry(kind: str, engines: int = 32, blocks: int = 2000) -> float:
    """Bytes one (engine, block) entry costs in ``kind``'s index, hash objects included (a live
    gateway decodes a new int per event), by ``tracemalloc`` on chains with a shared quarter."""
    rng = random.Random(5)
    shared = [rng.getrandbits(63) for _ in range(blocks // 4)]
    tracemalloc.start()
    idx = _new_index(kind, 1 << 20, blocks)
    for e in range(engines):
        chain = shared + [rng.getrandbits(63) for _ in range(blocks - len(shared))]
        for i in range(0, len(chain), 64):
            idx.apply_stored(f"e{e}", chain[i : i + 64])
    used, _ = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    return used / (engines * blocks)


def _sum_counts(counts: Iterable[EngineCounts]) -> EngineCounts:
    out = EngineCounts()
    for c in counts:
        out.prefilling += c.prefilling
        out.backlog_tokens += c.backlog_tokens
        out.decoding += c.decoding
        out.tokens += c.tokens
    return out


class _TimedCore(RoutingCore):
    """The routing core, timing what a replica spends deciding (matching, scoring)."""

    decide_s = 0.0
    decisions = 0

    def on_arrival(
        self,
        turn: Turn,
        index: IndexKind,
        record: SessionRecord | None,
        parent: SessionRecord | None,
        engines: tuple[EngineView, ...],
        now: float,
    ) -> Arrival:
        t0 = time.perf_counter()
        a = super().on_arrival(turn, index, record, parent, engines, now)
        self.decide_s += time.perf_counter() - t0
        return a

    def decide(self, a: Arrival) -> Decision:
        t0 = time.perf_counter()
        d = super().decide(a)
        self.decide_s += time.perf_counter() - t0
        self.decisions += 1
        return d


class _Replica:
    def __init__(self, core: _TimedCore, names: list[str]) -> None:
        self.core = core
        self.load = InflightLoad(names)
        self.inflight = [0] * len(names)
        self.pending: deque[tuple[float, str, list[int], list[int]]] = deque()
        self.gap: set[str] = set()
        """Engines whose next delivered batch reveals a lost one (entries cleared then)."""


class FleetSimulator(Simulator):
    def __init__(self, cfg: SimConfig, fleet: FleetConfig) -> None:
        if cfg.load_view != "gateway":
            cfg = replace(cfg, load_view="gateway")  # each replica's own ledger
        super().__init__(cfg)
        self.fleet = fleet
        self.rng = random.Random(fleet.seed)
        names = [e.name for e in self.engines]
        router = self.core.router
        self.replicas = []
        for _ in range(fleet.replicas):
            core = _TimedCore(router, cfg.index_capacity_blocks, cfg.engine.num_blocks)
            core.indexes[IndexKind.PRECISE] = _new_index(  # type: ignore[assignment]
                fleet.index, cfg.index_capacity_blocks, cfg.engine.num_blocks
            )
            self.replicas.append(_Replica(core, names))
        self._of: dict[int, _Replica] = {}
        self._cur = self.replicas[0]
        self._use(self._cur)
        self._pending_writes: deque[tuple[float, Write]] = deque()
        self._scraped: tuple[EngineView, ...] | None = None
        self._scraped_at = -1e18
        self.events_lost = 0
        self.clears = 0

    def _use(self, rep: _Replica) -> None:
        self._cur = rep
        self.core = rep.core
        self.load = rep.load
        self.index = rep.core.index

    # -- KV events: each replica's own delay and losses ----------------------------------------
    def _on_kv(self, engine: str, stored: list[int], removed: list[int]) -> None:
        f = self.fleet
        for rep in self.replicas:
            if f.event_loss and self.rng.random() < f.event_loss:
                rep.gap.add(engine)
                self.events_lost += 1
                continue
            if f.event_delay_s:
                rep.pending.append((self.now + f.event_delay_s, engine, stored, removed))
            else:
                self._apply(rep, engine, stored, removed)

    def _apply(self, rep: _Replica, engine: str, stored: list[int], removed: list[int]) -> None:
        idx = rep.core.index
        if engine in rep.gap:  # a sequence gap: the engine's entries are not trusted any more
            rep.gap.discard(engine)
            if self.fleet.on_gap == "clear":
                idx.clear(engine)
                self.clears += 1
        if removed:
            idx.apply_removed(engine, removed)
        if stored:
            idx.apply_stored(engine, stored)

    def _deliver(self, rep: _Replica, now: float) -> None:
        q = rep.pending
        while q and q[0][0] <= now:
            _, engine, stored, removed = q.popleft()
            self._apply(rep, engine, stored, removed)

    # -- the shared store's latency --------------------------------------------------------------
    def _write(self, writes: list[Write], now: float) -> None:
        lat = self.fleet.store_latency_s
        if lat <= 0:
            super()._write(writes, now)
            return
        for w in writes:
            self._pending_writes.append((now + lat, w))

    def _flush_writes(self, now: float) -> None:
        q = self._pending_writes
        while q and q[0][0] <= now:
            t, w = q.popleft()
            w.done(self.sessions.update(w.session_id, t, w.apply))

    # -- each replica's load view ----------------------------------------------------------------
    def engine_views(self) -> tuple[EngineView, ...]:
        if self.now - self._scraped_at >= self.fleet.scrape_s or self._scraped is None:
            self._scraped = tuple(
                EngineView(
                    name=e.name,
                    pool=self._roles[i][0],
                    role=self._roles[i][1],
                    models=self._models,
                    running=len(e.running),
                    waiting=len(e.waiting),
                    kv_usage=e.kv_usage,
                    capacity_blocks=e.cfg.num_blocks,
                )
                for i, e in enumerate(self.engines)
            )
            self._scraped_at = self.now
        if self.fleet.shared_load:
            return tuple(
                merge(
                    replace(v, inflight=sum(r.inflight[i] for r in self.replicas)),
                    _sum_counts(r.load.of(v.name) for r in self.replicas),
                )
                for i, v in enumerate(self._scraped)
            )
        rep = self._cur
        return tuple(
            merge(replace(v, inflight=rep.inflight[i]), rep.load.of(v.name))
            for i, v in enumerate(self._scraped)
        )

    # -- a request: a replica drawn at random --------------------------------------------------
    def _arrive(self, st: object, idx: int, now: float) -> None:
        rep = self.replicas[self.rng.randrange(len(self.replicas))]
        self._use(rep)
        self._flush_writes(now)
        self._deliver(rep, now)
        rid = self._rid + 1
        super()._arrive(st, idx, now)  # type: ignore[arg-type]
        self._of[rid] = rep
        live = self._live.get(rid)
        if live is not None:
            rep.inflight[live.engine] += 1

    def _on_first(self, s: Seq) -> None:
        rep = self._of.get(s.rid)
        if rep is not None:
            self._use(rep)
        super()._on_first(s)

    def _complete(self, s: Seq, ei: int, now: float) -> None:
        rep = self._of.pop(s.rid)
        self._use(rep)
        self._flush_writes(now)
        rep.inflight[ei] -= 1
        super()._complete(s, ei, now)
        # the two store round trips a replica makes before it forwards
        self.records[-1].t_first += 2 * self.fleet.store_latency_s

    def run(self, plays: Sequence[Play]) -> list:  # type: ignore[type-arg]
        out = super().run(plays)
        self._flush_writes(float("inf"))
        return out

    # -- reports ---------------------------------------------------------------------------------
    def decision_us(self) -> float:
        """Mean wall time of one routing decision on its replica (the core's ``on_arrival``:
        prefix matches and the router's input; ``decide``: filters, scorers, picker), us."""
        n = sum(r.core.decisions for r in self.replicas)
        return 1e6 * sum(r.core.decide_s for r in self.replicas) / n if n else 0.0

    def index_entries(self) -> list[int]:
        """(engine, block) entries each replica's precise index holds now."""
        out = []
        for rep in self.replicas:
            idx = rep.core.index
            ent = getattr(idx, "entries", None)
            out.append(ent() if ent is not None else sum(idx.engine_blocks(e.name) for e in self.engines))
        return out
