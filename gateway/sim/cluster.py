"""The discrete-event cluster simulator: plays -> gateway (the real router) -> modeled engines.

Virtual time, one heap of events: a request *arrives* when its dependencies are met (see
:mod:`gateway.sim.traces`) and is routed by the gateway's own routing core
(:class:`gateway.core.routing.RoutingCore`, the object ``gateway/service/placement.py`` drives:
the real :class:`~gateway.core.router.Router`, the prefix indexes, the homes, the in-flight
subagents) with the same calls in the same order: ``on_arrival`` with the session's and the
parent's records from the session table and the engines' views (the gateway's in-flight counts),
``decide``, ``on_routed``, and ``on_finished`` when the request completes. The prefix index is fed
by the engines' KV events (``precise``) or by the routing decisions themselves (``approx``, the
SGLang router's view); with hints, the session table keeps each session's home and its parent.

Replay modes: ``lanes=L`` (Dynamo's ``agentic_lanes``: L plays at a time, each lane starts its
next play when the previous one has completed) or ``lanes=None`` (open loop: each play starts at
its recorded ``start_s``, e.g. Mooncake). ``speedup`` divides every recorded gap and start time.

Pools: ``first_turn_workers=F`` makes the first F engines a ``first_turn`` pool and the rest a
``warm`` pool (the real router's ``pool_role`` filter splits on estimated uncached tokens against
``RoutingParams.first_turn_threshold_tokens``); 0 = one pool of role ``any``.

Role controller (``roles``, :class:`gateway.core.roles.RoleParams`): every ``interval_s`` of
virtual time the real :class:`gateway.core.roles.RoleController` reads each engine's prefill
backlog, decoding sequences and KV usage and may flip one engine between ``first_turn`` and
``warm`` (pool names ``first`` / ``warm``); the initial layout is ``first_turn_workers``.

Load view (``load_view``): ``engine`` gives the router each engine's exact decoding count and
prefill backlog from the engine model; ``gateway`` gives what the live gateway knows
(:mod:`gateway.core.load`, the same ledger and merge as ``gateway/service/cluster.py``): a
request is prefilling with its decision's uncached tokens from its dispatch to its first token,
then decoding until it completes, and the scraped running count bounds decoding from below.

KV tiers (``tiers``, :mod:`gateway.sim.tiers`): a host tier per engine and a shared store,
written through; an engine loads a prefix it lacks on device from them instead of recomputing it,
and their KV events (medium CPU / STORAGE) reach the prefix index.

Planner hook: ``planner.after_turn(sim, record)`` is called after each completed request, where
the gateway calls its planner (``Placement.after_turn``); ``planner.on_next_turn(...)`` after
each session request is routed (``MigrationExecutor.on_next_turn``); control requests
(prefetches, negative ids) submitted with :meth:`Simulator.submit_control` come back through
``planner.on_control_done``. :class:`gateway.sim.migrations.SimMigrations` is the executor.
"""

from __future__ import annotations

import heapq
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any, Protocol

from gateway.core.hints import AgentHints
from gateway.core.load import InflightLoad, Ticket, merge
from gateway.core.roles import EngineLoad, RoleController, RoleParams
from gateway.core.router import Router, RoutingParams
from gateway.core.routing import Arrival, RoutingCore, Write
from gateway.core.sessions import SessionTable
from gateway.core.turn import Turn, index_for, restarts
from gateway.core.types import Decision, EngineView, Medium, PoolRole
from gateway.sim.engine import DYNAMO_MOCKER, Engine, EngineConfig, Seq
from gateway.sim.tiers import Tiers, TiersConfig
from gateway.sim.traces import DISPATCH, Play, TraceRequest

__all__ = ["Planner", "RequestRecord", "SimConfig", "Simulator", "simulate"]


MODEL = "agent-model"
_NEEDS_PRECISE = {"agentic", "precise_prefix"}


@dataclass(frozen=True, slots=True)
class SimConfig:
    workers: int = 4
    engine: EngineConfig = DYNAMO_MOCKER
    profile: str = "round_robin"
    hints: bool = False
    """Send the agent hints (session id, parent id, expected tool latency) to the gateway."""
    tool_latency_hint: bool = True
    """With ``hints``: send the expected tool latency too (False: the gateway predicts each
    session's gap from its observed gaps)."""
    lanes: int | None = 16
    speedup: float = 1.0
    routing: RoutingParams | None = None
    index_capacity_blocks: int = 1 << 20
    label: str = ""
    first_turn_workers: int = 0
    """The first N engines form a ``first_turn`` pool, the rest a ``warm`` pool (0: one pool)."""
    tiers: TiersConfig | None = None
    """Host tier + shared store under the device caches (None: recompute what is not on device)."""
    kv_events: bool | None = None
    """Engines publish KV events to the precise index (None: for the profiles that read it, as
    a gateway would be configured for them); without, the approximate index learns from the
    routing decisions (``gateway.core.turn.index_for``)."""
    roles: RoleParams | None = None
    """Drive the role controller in virtual time (None: roles stay as laid out)."""
    load_view: str = "engine"
    """``engine``: the router sees the engine model's exact decoding count and prefill backlog;
    ``gateway``: what the live gateway's load ledger knows (see the module docstring)."""


@dataclass(slots=True)
class RequestRecord:
    play: str
    stream: str
    idx: int
    engine: str
    t_arrive: float
    t_first: float
    t_last: float
    input_tokens: int
    output_tokens: int
    cached_tokens: int
    recomputed_tokens: int
    reason: str
    session_id: str | None = None
    fan_out: int = 0
    loaded_tokens: int = 0
    """Prompt tokens loaded from the host tier / store (part of ``cached_tokens``)."""


class Planner(Protocol):
    def after_turn(self, sim: Simulator, record: RequestRecord) -> None: ...

    def on_next_turn(
        self, sim: Simulator, session_id: str, decision: Decision, play: str, idx: int
    ) -> None: ...

    def on_control_done(self, sim: Simulator, seq: Seq, engine: int) -> None: ...


@dataclass(slots=True)
class _PlayState:
    play: Play
    start: float
    lane: int | None
    waiting_deps: list[int]
    ready_at: list[float]
    dependents: list[list[tuple[int, str, float]]]
    done: int = 0


@dataclass(slots=True)
class _Inflight:
    state: _PlayState
    req: TraceRequest
    engine: int
    arrival: Arrival
    """As routed (its hints are empty when the gateway keeps no session record for it)."""
    decision: Decision
    ticket: Ticket | None = None


_ARRIVE, _PASS, _PLAY, _WAKE, _TICK = 0, 1, 2, 3, 4
_ROLE_POOL = {PoolRole.FIRST_TURN: "first", PoolRole.WARM: "warm"}


class Simulator:
    def __init__(self, cfg: SimConfig, planner: Planner | None = None) -> None:
        self.cfg = cfg
        self.planner = planner
        params = cfg.routing or RoutingParams(profile=cfg.profile)
        if params.profile != cfg.profile:
            params = RoutingParams(**{**_params_dict(params), "profile": cfg.profile})
        self.core = RoutingCore(Router(params), cfg.index_capacity_blocks, cfg.engine.num_blocks)
        self.index = self.core.index
        self.sessions = SessionTable(capacity=100_000, ttl_s=24 * 3600.0)
        # the trace's block hashes are exact; KV events feed the precise index only for the
        # profiles that read it (the others ignore prefix matches: skipping them saves time)
        self._kv_events = cfg.kv_events if cfg.kv_events is not None else cfg.profile in _NEEDS_PRECISE
        self._index_kind = index_for(True, self._kv_events)
        on_kv = self._on_kv if self._kv_events else None
        names = [f"w{i}" for i in range(cfg.workers)]
        self.tiers = (
            Tiers(cfg.tiers, names, self._on_tier_kv if on_kv is not None else None)
            if cfg.tiers is not None
            else None
        )
        self.engines = [Engine(n, cfg.engine, on_kv, self.tiers) for n in names]
        if cfg.load_view not in ("engine", "gateway"):
            raise ValueError(f"unknown load_view {cfg.load_view!r}; choose 'engine' or 'gateway'")
        self.load = InflightLoad(names) if cfg.load_view == "gateway" else None
        if self.load is not None:
            for e in self.engines:
                e.on_first = self._on_first
        ft = cfg.first_turn_workers
        self._roles = [
            (("first", PoolRole.FIRST_TURN) if i < ft else ("warm", PoolRole.WARM))
            if ft > 0
            else (("warm", PoolRole.WARM) if cfg.roles is not None else ("default", PoolRole.ANY))
            for i in range(cfg.workers)
        ]
        self.controller = (
            RoleController(cfg.roles, {n: r for n, (_, r) in zip(names, self._roles, strict=True)}, 0.0)
            if cfg.roles is not None
            else None
        )
        self.role_changes = 0
        self._wake_at: list[float | None] = [None] * cfg.workers
        self._ctrl_rid = 0
        self._by_name = {e.name: i for i, e in enumerate(self.engines)}
        self._inflight_n = [0] * cfg.workers
        self._pass_version = [0] * cfg.workers
        self._heap: list[tuple[float, int, int, Any]] = []
        """(time, tiebreak, kind, payload); the payload's type depends on the kind (see run)."""
        self._tick = 0
        self._seq = 0
        self._live: dict[int, _Inflight] = {}
        self._rid = 0
        self.records: list[RequestRecord] = []
        self.migrations = 0
        self.session_restarts = 0
        self.kv_bytes_moved = 0
        self.now = 0.0
        self.plays: dict[str, Play] = {}
        self._models = frozenset({MODEL})

    # -- events -----------------------------------------------------------------------------
    def _push(self, t: float, kind: int, payload: object) -> None:
        self._tick += 1
        heapq.heappush(self._heap, (t, self._tick, kind, payload))

    def _on_kv(self, engine: str, stored: list[int], removed: list[int]) -> None:
        if removed:
            # with tiers, a block evicted from device memory may still be in the host tier
            self.index.apply_removed(engine, removed, Medium.GPU if self.tiers is not None else None)
        if stored:
            self.index.apply_stored(engine, stored)

    def _on_tier_kv(self, engine: str, stored: list[int], removed: list[int], medium: Medium) -> None:
        if removed:
            self.index.apply_removed(engine, removed, medium)
        if stored:
            self.index.apply_stored(engine, stored, medium)

    # -- plays ------------------------------------------------------------------------------
    def _start_play(self, play: Play, t: float, lane: int | None) -> None:
        n = len(play.requests)
        dependents: list[list[tuple[int, str, float]]] = [[] for _ in range(n)]
        waiting = [0] * n
        for r in play.requests:
            waiting[r.idx] = len(r.deps)
            for d in r.deps:
                dependents[d.on].append((r.idx, d.trigger, d.delay_s))
        st = _PlayState(play, t, lane, waiting, [t] * n, dependents)
        sp = self.cfg.speedup
        for r in play.requests:
            if not r.deps:
                first = min(q.t for q in play.requests)
                self._push(t + (r.t - first) / sp, _ARRIVE, (st, r.idx))

    def _trigger(self, st: _PlayState, idx: int, trigger: str, t: float) -> None:
        sp = self.cfg.speedup
        for j, trig, delay in st.dependents[idx]:
            if trig != trigger:
                continue
            st.ready_at[j] = max(st.ready_at[j], t + delay / sp)
            st.waiting_deps[j] -= 1
            if st.waiting_deps[j] == 0:
                self._push(st.ready_at[j], _ARRIVE, (st, j))

    # -- routing ----------------------------------------------------------------------------
    def engine_index(self, engine: str) -> int:
        return self._by_name[engine]

    def sessions_hashes(self, session_id: str) -> list[int]:
        rec = self.sessions.get(session_id, self.now)
        return rec.prefix_hashes if rec is not None else []

    def pool_of(self, engine: str) -> str:
        return self._roles[self._by_name[engine]][0]

    def views(self) -> tuple[EngineView, ...]:
        return self._views()

    def _views(self) -> tuple[EngineView, ...]:
        """The engines as the gateway sees them, with the live sessions' context homed on each."""
        return self.core.views(self.engine_views(), self.now)

    def engine_views(self) -> tuple[EngineView, ...]:
        """The engines as the gateway's cluster reports them (``Cluster.views()``: load and KV,
        no sessions' context), what the planner reads after a turn."""
        roles = self._roles
        load = self.load
        exact = load is None  # the engine model's own load fields, else the gateway's ledger
        views = []
        for i, e in enumerate(self.engines):
            view = EngineView(
                name=e.name,
                pool=roles[i][0],
                role=roles[i][1],
                models=self._models,
                running=len(e.running),
                waiting=len(e.waiting),
                kv_usage=e.kv_usage,
                inflight=self._inflight_n[i],
                capacity_blocks=e.cfg.num_blocks,
                decoding=e.decoding if exact else 0,
                prefill_backlog_tokens=e.prefill_backlog_tokens() if exact else 0,
            )
            views.append(view if load is None else merge(view, load.of(e.name)))
        return tuple(views)

    def _control_roles(self, now: float) -> None:
        """A controller tick: measure, decide, apply; re-armed while other events are pending."""
        ctl = self.controller
        assert ctl is not None
        if self.load is not None:
            loads = [
                EngineLoad(v.name, v.prefill_backlog_tokens, v.decoding, v.kv_usage) for v in self._views()
            ]
        else:
            loads = [
                EngineLoad(e.name, e.prefill_backlog_tokens(), e.decoding, e.kv_usage) for e in self.engines
            ]
        for ch in ctl.step(now, loads):
            self._roles[self._by_name[ch.engine]] = (_ROLE_POOL[ch.role], ch.role)
            self.role_changes += 1
        if self._heap:
            self._push(now + ctl.params.interval_s, _TICK, None)

    def _arrive(self, st: _PlayState, idx: int, now: float) -> None:
        """Route a request through the routing core (:class:`gateway.core.routing.RoutingCore`),
        as ``gateway/service/placement.py`` does, then hand it to its engine."""
        play, r = st.play, st.play.requests[idx]
        cfg = self.cfg
        use_ids = cfg.hints or cfg.profile == "session_hash"
        sid = play.session_id(r.stream) if use_ids else None
        parent_id = play.play_id if (use_ids and cfg.hints and r.stream != "root") else None
        hints = AgentHints(
            session_id=sid,
            parent_session_id=parent_id,
            fan_out=(play.subagents.get(r.stream, 0) or None) if cfg.hints else None,
            expected_tool_latency_ms=(
                round(1000 * r.gap_s / cfg.speedup) if cfg.hints and cfg.tool_latency_hint else None
            ),
        )
        self._seq += 1
        turn = Turn(MODEL, r.input_tokens, play.block_size, hints, r.hashes, self._seq)
        rec = self.sessions.get(sid, now) if (cfg.hints and sid is not None) else None
        if restarts(rec, turn):
            self.session_restarts += 1
        parent = self.sessions.get(parent_id, now) if parent_id is not None else None
        core = self.core
        a = core.on_arrival(turn, self._index_kind, rec, parent, self.engine_views(), now)
        d = core.decide(a)
        ei = self._by_name[d.engine]
        if self.planner is not None and cfg.hints and sid is not None:
            self.planner.on_next_turn(self, sid, d, play.play_id, r.idx)
        if not cfg.hints:
            # without hints a session id only keys ``session_hash``: no session record is kept
            a = replace(a, turn=replace(turn, hints=AgentHints()))
        self._write(core.on_routed(a, d, now), now)
        self._rid += 1
        rid = self._rid
        ticket = (
            self.load.sent(d.engine, d.uncached_tokens, r.input_tokens) if self.load is not None else None
        )
        self._live[rid] = _Inflight(st, r, ei, a, d, ticket)
        self._inflight_n[ei] += 1
        self._trigger(st, idx, DISPATCH, now)
        self._submit(ei, Seq(rid, r.input_tokens, r.output_tokens, r.hashes, now), now)

    def _write(self, writes: list[Write], now: float) -> None:
        for w in writes:
            w.done(self.sessions.update(w.session_id, now, w.apply))

    def _submit(self, ei: int, seq: Seq, now: float) -> None:
        self.engines[ei].add(seq)
        self._nudge(ei, now)

    def _nudge(self, ei: int, now: float) -> None:
        """New work for engine ``ei``: start a pass if it is idle, else reschedule its pass end."""
        eng = self.engines[ei]
        if not eng.busy:
            self._kick(ei, now)
        else:
            end = eng.interrupt(now)
            if end is not None:
                self._pass_version[ei] += 1
                self._push(end, _PASS, (ei, self._pass_version[ei]))

    def submit_control(self, engine: str, prompt: int, hashes: list[int]) -> Seq:
        """A control request (engine_ext's prefetch: a 1-token completion of the prefix) on
        ``engine``; it comes back through ``planner.on_control_done``, not as a record."""
        self._ctrl_rid -= 1
        seq = Seq(self._ctrl_rid, prompt, 1, hashes, self.now)
        self._submit(self._by_name[engine], seq, self.now)
        return seq

    def _kick(self, ei: int, now: float) -> None:
        eng = self.engines[ei]
        end = eng.start_pass(now)
        if end is not None:
            self._pass_version[ei] += 1
            self._push(end, _PASS, (ei, self._pass_version[ei]))
        if eng.loading:
            self._arm_wake(ei)

    def _arm_wake(self, ei: int) -> None:
        """Wake the engine when its next load completes (an idle engine has no pass to end)."""
        now = self.now
        t = min((s.ready_at for s in self.engines[ei].loading if s.ready_at > now), default=None)
        if t is None:
            return  # loads already complete are taken by the next pass
        cur = self._wake_at[ei]
        if cur is None or t < cur or cur < self.now:
            self._wake_at[ei] = t
            self._push(t, _WAKE, ei)

    def _wake(self, ei: int, now: float) -> None:
        if self._wake_at[ei] == now:
            self._wake_at[ei] = None
        self._nudge(ei, now)
        if self.engines[ei].loading:
            self._arm_wake(ei)

    def _pass_end(self, ei: int, now: float) -> None:
        eng = self.engines[ei]
        for s in eng.finish_pass(now):
            if s.rid < 0:
                if self.planner is not None:
                    self.planner.on_control_done(self, s, ei)
            else:
                self._complete(s, ei, now)
        self._kick(ei, now)

    def _on_first(self, s: Seq) -> None:
        live = self._live.get(s.rid)
        if live is not None and live.ticket is not None and self.load is not None:
            self.load.first_byte(live.ticket)

    def _complete(self, s: Seq, ei: int, now: float) -> None:
        live = self._live.pop(s.rid)
        if live.ticket is not None and self.load is not None:
            self.load.finished(live.ticket)
        self._inflight_n[ei] -= 1
        name = self.engines[ei].name
        r, st = live.req, live.state
        rec = RequestRecord(
            play=st.play.play_id,
            stream=r.stream,
            idx=r.idx,
            engine=name,
            t_arrive=s.t_arrive,
            t_first=s.t_first,
            t_last=s.t_last,
            input_tokens=s.prompt,
            output_tokens=s.max_out,
            cached_tokens=max(0, s.cached_tokens),
            recomputed_tokens=s.recomputed,
            reason=live.decision.reason,
            session_id=live.arrival.turn.hints.session_id,
            fan_out=live.arrival.request.fan_out,
            loaded_tokens=s.loaded,
        )
        self.records.append(rec)
        self._write(self.core.on_finished(live.arrival, live.decision, name, True, now), now)
        if s.max_out > 1 and s.t_last > s.t_first:
            self.core.observe((s.max_out - 1) / (s.t_last - s.t_first))
        if self.planner is not None:
            self.planner.after_turn(self, rec)
        self._trigger(st, r.idx, "completion", now)
        st.done += 1
        if st.done == len(st.play.requests) and st.lane is not None:
            self._push(now, _PLAY, st.lane)

    # -- run --------------------------------------------------------------------------------
    def run(self, plays: Sequence[Play]) -> list[RequestRecord]:
        queue = deque(plays)
        self.plays = {p.play_id: p for p in plays}
        if self.cfg.lanes is None:
            for p in queue:
                self._start_play(p, p.start_s / self.cfg.speedup, None)
            queue.clear()
        else:
            for lane in range(min(self.cfg.lanes, len(queue))):
                self._start_play(queue.popleft(), 0.0, lane)
        heap = self._heap
        pop = heapq.heappop
        if self.controller is not None:
            self._push(self.controller.params.interval_s, _TICK, None)
        st: _PlayState
        idx: int
        ei: int
        version: int
        while heap:
            t, _, kind, payload = pop(heap)
            self.now = t
            if kind == _ARRIVE:
                st, idx = payload
                self._arrive(st, idx, t)
            elif kind == _PASS:
                ei, version = payload
                if version == self._pass_version[ei]:
                    self._pass_end(ei, t)
            elif kind == _WAKE:
                self._wake(payload, t)  # payload: the engine index
            elif kind == _TICK:
                self._control_roles(t)
            elif queue:
                self._start_play(queue.popleft(), t, payload)  # payload: the lane
        return self.records


def _params_dict(p: RoutingParams) -> dict[str, Any]:
    return {k: getattr(p, k) for k in RoutingParams.__slots__}


def simulate(plays: Sequence[Play], cfg: SimConfig, planner: Planner | None = None) -> Simulator:
    sim = Simulator(cfg, planner)
    sim.run(plays)
    return sim
