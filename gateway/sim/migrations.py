"""The inter-turn planner in the simulator: the routing core's :meth:`gateway.core.routing.
RoutingCore.plan` (the real :func:`gateway.core.planner.plan_turn` with the core's move state and
its homes' projection of each engine's decode KV at the expected return), executed the way
``gateway/service/migrations.py`` executes it, in virtual time.

- **When** (``GatewayService._settle`` / ``after_turn``): after each completed request of a
  session (hints on), with the engines' views, the prefix-index matches of the session's last
  prompt hashes and the gap: the hinted tool latency (the trace's recorded think time before the
  session's next request, divided by the speed-up: an exact hint; ``SimConfig.tool_latency_hint``
  False withholds it), else the session's median observed gap, else ``default_gap_s``. The last
  request of a stream ends the session (``end_session``: cancel what is pending, ``release``).
- **Pins** (engine_ext): every session turn pins the session's blocks in its engine's host tier for
  ``min(gap + pin_margin_s, max_pin_s)`` (the gateway forwards that pin in
  ``kv_transfer_params.agentgw``); ``stay`` also soft-pins them in the home's device cache for the
  TTL (``device_pins``; engine_ext itself can only pin host chunks), ``demote`` pins them in the
  host tier only, ``release`` unpins everything the session holds.
- **move / replicate**: a prefetch per target, i.e. what ``POST /v1/kv/prefetch`` does: a
  1-token completion of the session's prefix (its full blocks) on the target, through the target's
  normal scheduler, so the prefix is loaded from the target's host tier / the store at the tier
  bandwidths (:mod:`gateway.sim.tiers`) and only what no tier holds is recomputed; its KV
  events reach the prefix index. At most ``max_per_engine`` prefetches run per target, the others
  queue (the executor's per-target semaphore). A ``move`` re-homes the session only once its
  prefetch completed, and only if the session is idle and still homed at the source; a new plan
  or the session's next turn arriving first cancels it (a queued prefetch is dropped, one still
  waiting in the target's queue is removed, one already loading or running completes without
  effect).

Counted: KV bytes moved (blocks a prefetch loaded onto a target's device from its host tier or
the store, x block bytes), migrations (completed moves that re-homed a session), actions by kind
and reason, prefetches recomputed, and for every next turn of a session that was moved, its
``(play, idx)`` so the report can compare that turn across policies.
"""

from __future__ import annotations

from collections import Counter, deque
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from gateway.core.planner import ActionKind, PlanAction, PlannerParams, TurnOutcome
from gateway.core.turn import IndexKind
from gateway.core.types import Decision
from gateway.sim.engine import Seq

if TYPE_CHECKING:
    from gateway.sim.cluster import RequestRecord, Simulator

__all__ = ["SimMigration", "SimMigrations"]


@dataclass(slots=True)
class SimMigration:
    action: PlanAction
    started: float
    hashes: list[int]
    state: str = "running"
    pending: dict[str, Seq | None] = field(default_factory=dict)
    """target -> its prefetch request (None while queued behind the per-target cap)."""
    ready: dict[str, float] = field(default_factory=dict)
    """target -> seconds from start until its prefetch completed."""


class SimMigrations:
    """The planner hook of :class:`gateway.sim.cluster.Simulator`."""

    def __init__(
        self,
        params: PlannerParams | None = None,
        max_per_engine: int = 2,
        device_pins: bool = True,
    ) -> None:
        self.params = params or PlannerParams()
        self.max_per_engine = max_per_engine
        self.device_pins = device_pins
        self.current: dict[str, SimMigration] = {}
        self._by_rid: dict[int, tuple[SimMigration, str]] = {}
        self._active: Counter[str] = Counter()
        self._queue: dict[str, deque[tuple[SimMigration, str]]] = {}
        self._pins: dict[str, set[tuple[str, bool]]] = {}
        """session -> (engine, device?) it holds pins on."""
        self._next: dict[str, list[int]] = {}
        """play -> request idx -> idx of the same stream's next request (-1: last)."""
        self.actions: Counter[str] = Counter()
        self.stats: Counter[str] = Counter()
        self.moved_next: list[tuple[str, int]] = []
        """(play, idx) of next turns whose session a completed move re-homed."""
        self.planned_next: list[tuple[str, int]] = []
        """(play, idx) of next turns of sessions a move was planned for (done or not)."""
        self.slack_s: list[float] = []
        """For completed moves: gap until the next turn minus the prefetch time."""
        self._moved: dict[str, float] = {}

    # -- the hook ------------------------------------------------------------------------------
    def _next_idx(self, sim: Simulator, play_id: str, idx: int) -> int:
        nxt = self._next.get(play_id)
        if nxt is None:
            play = sim.plays[play_id]
            nxt = [-1] * len(play.requests)
            last: dict[str, int] = {}
            for r in sorted(play.requests, key=lambda q: q.idx):
                if r.stream in last:
                    nxt[last[r.stream]] = r.idx
                last[r.stream] = r.idx
            self._next[play_id] = nxt
        return nxt[idx]

    def after_turn(self, sim: Simulator, record: RequestRecord) -> None:
        sid = record.session_id
        if sid is None:
            return
        now = sim.now
        srec = sim.sessions.get(sid, now)
        if srec is None:
            return
        p = self.params
        nxt = self._next_idx(sim, record.play, record.idx)
        if nxt < 0:  # the stream's last request: the harness ends the session
            self.cancel(sim, sid, "session_end")
            self._execute(sim, PlanAction(ActionKind.RELEASE, sid, record.engine, reason="session_end"), [])
            return
        hinted = None
        if sim.cfg.hints and sim.cfg.tool_latency_hint:
            hinted = sim.plays[record.play].requests[nxt].gap_s / sim.cfg.speedup
        gap = p.gap_s(hinted, srec.expected_gap())
        hashes = srec.prefix_hashes
        # engine_ext pins the turn's host chunks for the expected gap (kv_transfer_params.agentgw)
        if sim.tiers is not None:
            sim.tiers.pin_host(record.engine, hashes, now + p.pin_ttl_s(gap))
            self._pins.setdefault(sid, set()).add((record.engine, False))
        ctx = srec.context_tokens
        turn = TurnOutcome(
            session_id=sid,
            home=record.engine,
            context_tokens=ctx,
            gap_s=gap,
            fan_out=record.fan_out,
            is_subagent=srec.parent is not None,
            block_size=sim.cfg.engine.block_size,
        )
        self.cancel(sim, sid, "new_plan")
        self.current.pop(sid, None)
        action = sim.core.plan(turn, sim.engine_views(), IndexKind.PRECISE, hashes, p, now)
        if self._execute(sim, action, hashes) is None:
            sim.core.move_ended(sid)

    def on_next_turn(self, sim: Simulator, session_id: str, decision: Decision, play: str, idx: int) -> None:
        self.cancel(sim, session_id, "next_turn_arrived")
        m = self.current.pop(session_id, None)
        if m is None or m.action.kind != ActionKind.MOVE:
            return
        self.planned_next.append((play, idx))
        if m.state == "done" and session_id in self._moved:
            self.moved_next.append((play, idx))
            self.stats["moved_next_turn_on_target"] += decision.engine == m.action.targets[0]
            ready = max(m.ready.values(), default=0.0)
            self.slack_s.append(sim.now - m.started - ready)
            del self._moved[session_id]

    def on_control_done(self, sim: Simulator, seq: Seq, engine: int) -> None:
        m, target = self._by_rid.pop(seq.rid)
        self._active[target] -= 1
        bb = sim.tiers.block_bytes if sim.tiers is not None else 0
        moved = seq.loaded // sim.engines[engine].bs * bb
        sim.kv_bytes_moved += moved
        self.stats["prefetch_done"] += 1
        self.stats["prefetch_loaded_tokens"] += seq.loaded
        self.stats["prefetch_recomputed_tokens"] += max(0, seq.prompt - max(0, seq.cached_tokens))
        self._drain(sim, target)
        if m.state != "running":
            return
        m.pending.pop(target, None)
        m.ready[target] = sim.now - m.started
        if m.pending:
            return
        m.state = "done"
        a = m.action
        sim.core.move_ended(a.session_id)
        self.stats[f"{a.kind.value}_done"] += 1
        if a.kind == ActionKind.MOVE:
            self._rehome(sim, a.session_id, a.source, a.targets[0])
        if self.device_pins:
            for t in a.targets:
                self._pin(sim, a.session_id, t, m.hashes, a.pin_ttl_s, device=True)

    # -- executing -----------------------------------------------------------------------------
    def submit(self, sim: Simulator, action: PlanAction, hashes: list[int]) -> SimMigration | None:
        self.cancel(sim, action.session_id, "new_plan")
        self.current.pop(action.session_id, None)
        return self._execute(sim, action, hashes)

    def _execute(self, sim: Simulator, a: PlanAction, hashes: list[int]) -> SimMigration | None:
        self.actions[f"{a.kind.value}:{a.reason}"] += 1
        sid = a.session_id
        if a.kind == ActionKind.RELEASE:
            self._release(sim, sid, hashes or sim.sessions_hashes(sid))
            return None
        if a.kind == ActionKind.STAY:
            if self.device_pins:
                self._pin(sim, sid, a.source, hashes, a.pin_ttl_s, device=True)
            return None
        if a.kind == ActionKind.DEMOTE:
            self._pin(sim, sid, a.source, hashes, a.pin_ttl_s, device=False)
            return None
        if not hashes:
            return None
        if a.kind == ActionKind.REPLICATE and self.device_pins:
            self._pin(sim, sid, a.source, hashes, a.pin_ttl_s, device=True)
        m = SimMigration(a, sim.now, list(hashes))
        self.current[sid] = m
        self.stats[f"{a.kind.value}_started"] += 1
        for t in a.targets:
            m.pending[t] = None
            self._queue.setdefault(t, deque()).append((m, t))
            self._drain(sim, t)
        return m

    def _drain(self, sim: Simulator, target: str) -> None:
        q = self._queue.get(target)
        while q and self._active[target] < self.max_per_engine:
            m, t = q.popleft()
            if m.state != "running" or t not in m.pending:
                continue
            bs = sim.engines[0].bs
            seq = sim.submit_control(t, len(m.hashes) * bs, m.hashes)
            m.pending[t] = seq
            self._by_rid[seq.rid] = (m, t)
            self._active[t] += 1

    def cancel(self, sim: Simulator, session_id: str, reason: str) -> bool:
        m = self.current.get(session_id)
        if m is None or m.state != "running":
            return False
        m.state = "cancelled"
        sim.core.move_ended(session_id)
        self.stats[f"{m.action.kind.value}_cancelled"] += 1
        self.stats[f"cancelled:{reason}"] += 1
        for t, seq in m.pending.items():
            if seq is None:
                continue  # queued: _drain skips it
            if sim.engines[sim.engine_index(t)].remove_waiting(seq.rid):
                self._by_rid.pop(seq.rid, None)
                self._active[t] -= 1
                self._drain(sim, t)
        return True

    def _rehome(self, sim: Simulator, sid: str, source: str, target: str) -> None:
        rec = sim.sessions.get(sid, sim.now)
        if rec is None or rec.ended or rec.home != source or rec.inflight:
            self.stats["rehome_skipped"] += 1
            return
        rec.home = target
        rec.pool = sim.pool_of(target)
        sim.sessions.put(rec)
        sim.core.on_moved(sid, target)
        sim.migrations += 1
        self._moved[sid] = sim.now

    def _pin(
        self, sim: Simulator, sid: str, engine: str, hashes: list[int], ttl: float, device: bool
    ) -> None:
        until = sim.now + ttl
        if device:
            sim.engines[sim.engine_index(engine)].soft_pin(hashes, until)
        elif sim.tiers is not None:
            sim.tiers.pin_host(engine, hashes, until)
        self._pins.setdefault(sid, set()).add((engine, device))

    def _release(self, sim: Simulator, sid: str, hashes: list[int]) -> None:
        for engine, device in self._pins.pop(sid, ()):
            if device:
                sim.engines[sim.engine_index(engine)].unpin(hashes)
            elif sim.tiers is not None:
                sim.tiers.unpin_host(engine, hashes)

    def summary(self) -> dict[str, object]:
        return {"actions": dict(self.actions), "stats": dict(self.stats)}
