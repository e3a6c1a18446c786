"""The routing core: the state that routing reads and writes, and a turn's three moments.

:class:`RoutingCore` owns the router, the two prefix indexes (precise: fed by the engines' KV
events; approximate: fed by the routing decisions), the homes of the live sessions
(:class:`~gateway.core.turn.HomeLedger`) and the in-flight subagents of each parent
(:class:`~gateway.core.turn.Siblings`). The session records are the caller's: the gateway keeps
them in its session store (memory or Redis, async), the simulator in a
:class:`~gateway.core.sessions.SessionTable`. The caller reads them before :meth:`on_arrival` and
applies the :class:`Write`\\ s that :meth:`on_routed` and :meth:`on_finished` return. Pure: no
I/O, the clock passed in as ``now``.

A turn, in the gateway (``gateway/service/placement.py``) and in the simulator
(``gateway/sim/cluster.py``) alike::

    a = core.on_arrival(turn, index, record, parent, engines, now)   # reads only
    d = core.decide(a)                    # the router; core.owner(a, engine) for a constraint
    for w in core.on_routed(a, d, now):   # committed: the index, the sibling, then the records
        w.done(store.update(w.session_id, now, w.apply))
    ... the engine serves the turn (or it never reaches one) ...
    for w in core.on_finished(a, d, served_on, ok, now):
        w.done(store.update(w.session_id, now, w.apply))

Every ``on_routed`` is followed by exactly one ``on_finished`` (the sibling counts and the homes'
in-flight counts rely on it); a turn refused before ``on_routed`` writes nothing.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, replace

from gateway.core import turn as steps
from gateway.core.planner import MoveState, PlanAction, PlannerParams, TurnOutcome, plan_turn
from gateway.core.prefix_index import PrefixIndex
from gateway.core.router import Router
from gateway.core.sessions import Mutation, SessionRecord
from gateway.core.turn import HomeLedger, IndexKind, Siblings, Turn
from gateway.core.types import Decision, EngineView, PrefixMatch, RouteRequest, Snapshot

__all__ = ["GATEWAY_RECENCY_SLACK", "Arrival", "MissBudget", "RoutingCore", "Write"]

#: The reason of an arrival-time move made as a deliberate TTFT miss (spends the budget).
MISS_REASON = "kv_balance_miss"


class MissBudget:
    """The deliberate TTFT misses among the last ``window`` routed turns: the SLO is a p90, so
    a few turns may go past the TTFT bound when that keeps many decoding at speed; at most
    ``share`` of the window do (0: none). And the decode speeds observed over the last
    ``window`` finished turns: while more than ``reach`` of them decoded under the tok/s bound,
    the bound is out of reach (its p90 is lost whatever moves) and no miss is spent on it."""

    __slots__ = ("_last", "_seen", "misses", "reach", "share", "slow", "window")

    def __init__(self, share: float, window: int = 1000, reach: float = 1.0) -> None:
        self.share = share
        self.window = max(1, window)
        self.reach = reach
        self._last: deque[bool] = deque(maxlen=self.window)
        self._seen: deque[bool] = deque(maxlen=self.window)
        self.misses = 0
        self.slow = 0

    def ok(self) -> bool:
        """Room for one more deliberate miss, and the decode-speed bound within reach."""
        if self.misses + 1 > self.share * self.window:
            return False
        return self.slow <= self.reach * max(1, len(self._seen))

    def record(self, miss: bool) -> None:
        """A routed turn: ``miss`` when it was sent past the TTFT bound on purpose."""
        if len(self._last) == self.window and self._last[0]:
            self.misses -= 1
        self._last.append(miss)
        self.misses += miss

    def observe(self, slow: bool) -> None:
        """A finished turn: ``slow`` when it decoded under the tok/s bound."""
        if len(self._seen) == self.window and self._seen[0]:
            self.slow -= 1
        self._seen.append(slow)
        self.slow += slow


def _nothing(_: SessionRecord | None) -> None:
    return None


@dataclass(frozen=True, slots=True)
class Write:
    """A read-modify-write of one session record, for the caller's store. ``apply`` is pure (it
    may run again when a Redis transaction retries; None: nothing to write); ``done`` takes the
    record as stored and does the core's own bookkeeping for it."""

    session_id: str
    apply: Mutation
    done: Callable[[SessionRecord | None], None] = _nothing


GATEWAY_RECENCY_SLACK = 0.25
"""The gateway's prefix indexes refresh a chain in use once per quarter of their capacity in
stored blocks, not on every turn (:class:`~gateway.core.prefix_index.PrefixIndex`)."""


@dataclass(frozen=True, slots=True)
class Arrival:
    """A turn as the router sees it, and what it was built from."""

    turn: Turn
    index: IndexKind
    """The index its hashes are matched against (:func:`~gateway.core.turn.index_for`)."""
    request: RouteRequest
    snapshot: Snapshot
    record: SessionRecord | None
    """The session's live record (None: a new session, an ended one, or no session)."""
    parent: SessionRecord | None


class RoutingCore:
    def __init__(
        self,
        router: Router,
        index_capacity_blocks: int,
        approx_capacity_blocks: int | None = None,
        recency_slack: float = 0.0,
    ) -> None:
        """``recency_slack``: the indexes' :attr:`PrefixIndex.recency_slack` as a share of their
        capacity (0: a strict LRU, as the simulator runs; the gateway's is
        :data:`GATEWAY_RECENCY_SLACK`)."""
        self.router = router
        approx = approx_capacity_blocks or index_capacity_blocks
        self.indexes = {
            IndexKind.PRECISE: PrefixIndex(index_capacity_blocks, int(recency_slack * index_capacity_blocks)),
            IndexKind.APPROX: PrefixIndex(approx, int(recency_slack * approx)),
        }
        self.siblings = Siblings()
        self.homes = HomeLedger()
        p = router.params
        self.budget = MissBudget(p.slo_miss_budget, p.slo_miss_window, p.slo_miss_reach)
        """The deliberate TTFT misses of the last routed turns (``Snapshot.slo_miss_ok``)."""
        self.moves = MoveState()
        """The planner's move bounds (moves in flight per engine, recent starts, each session's
        last move): :meth:`plan` starts a move in it, :meth:`move_ended` ends one."""

    @property
    def index(self) -> PrefixIndex:
        """The index fed by the engines' KV events."""
        return self.indexes[IndexKind.PRECISE]

    # -- reading -------------------------------------------------------------------------------
    def views(self, engines: tuple[EngineView, ...], now: float) -> tuple[EngineView, ...]:
        """The engines with the live sessions' context homed on each (``homed_tokens``)."""
        homed = self.homes.homed(now)
        if not homed:
            return engines
        return tuple(replace(v, homed_tokens=homed.get(v.name, 0)) for v in engines)

    def matches(self, index: IndexKind, hashes: list[int]) -> dict[str, PrefixMatch]:
        return self.indexes[index].match(hashes)

    def on_arrival(
        self,
        turn: Turn,
        index: IndexKind,
        record: SessionRecord | None,
        parent: SessionRecord | None,
        engines: tuple[EngineView, ...],
        now: float,
    ) -> Arrival:
        """The router's input for ``turn``: ``record`` is its session's record, ``parent`` its
        parent session's (as read from the caller's store), ``engines`` the engines' views."""
        idx = self.indexes[index]
        parent_id = turn.hints.parent_session_id
        req, snap = steps.prepare(
            turn,
            record,
            parent,
            idx.match(turn.hashes),
            idx.match(parent.prefix_hashes) if parent is not None else {},
            self.views(engines, now),
            self.siblings.view(parent_id),
        )
        if self.router.params.slo_moves:
            snap = replace(snap, slo_miss_ok=self.budget.ok())
        live = record if record is not None and not record.ended else None
        return Arrival(turn, index, req, snap, live, parent)

    def decide(self, a: Arrival) -> Decision:
        """The router's decision (raises :class:`~gateway.core.router.NoEngine`)."""
        return self.router.route(a.request, a.snapshot)

    def owner(self, a: Arrival, engine: str) -> Decision | None:
        """``engine``, the only one that can serve the turn (None: it is gone)."""
        return steps.owner_decision(a.request, a.snapshot, engine, self.router.profile.name)

    # -- writing -------------------------------------------------------------------------------
    def on_routed(self, a: Arrival, d: Decision, now: float) -> list[Write]:
        """The turn goes to ``d.engine`` (admitted, about to be sent): the approximate index
        learns where its prefix went, the parent's fan-out counts one more sibling there; the
        writes give the session its new home and the parent its child."""
        turn = a.turn
        self.budget.record(d.reason == MISS_REASON)
        if a.index is IndexKind.APPROX:
            self.indexes[IndexKind.APPROX].apply_stored(d.engine, turn.hashes)
        sid = turn.hints.session_id
        if sid is None:
            return []
        parent_id = turn.hints.parent_session_id
        if parent_id is not None:
            self.siblings.add(parent_id, d.engine)
        homes = self.homes
        writes = [
            Write(
                sid,
                lambda rec: steps.place(rec, d, turn, now),
                lambda _: homes.placed(sid, d.engine, now),
            )
        ]
        if parent_id is not None and a.parent is not None and sid not in a.parent.children:
            writes.append(Write(parent_id, lambda p: steps.adopt(p, sid)))
        return writes

    def on_finished(
        self, a: Arrival, d: Decision, served_on: str | None, ok: bool, now: float
    ) -> list[Write]:
        """The turn is over (``served_on``: the engine that answered, None if none did): the
        sibling leaves the fan-out; the write records the turn in the session's history. The
        session's last turn (``session_end``) writes nothing: the caller ends the session
        (:meth:`on_ended`)."""
        h = a.turn.hints
        if h.parent_session_id is not None:
            self.siblings.remove(h.parent_session_id, d.engine)
        sid = h.session_id
        if sid is None or h.session_end:
            return []
        homes = self.homes
        turn = a.turn

        def settled(rec: SessionRecord | None) -> None:
            if rec is not None:
                homes.settled(sid, rec.home or d.engine, rec.context_tokens, now)

        return [Write(sid, lambda r: steps.settle(r, d.engine, served_on, ok, now, turn), settled)]

    def observe(self, tok_s: float) -> None:
        """A finished turn decoded at ``tok_s`` (its output tokens after the first over the time
        from the first to the last): what the miss budget reads of the decode-speed bound."""
        bound = self.router.params.interactivity_tok_s
        self.budget.observe(bound > 0 and tok_s < bound)

    def on_ended(self, session_id: str) -> None:
        """The session is over: it is homed nowhere."""
        self.homes.ended(session_id)

    def forget_engine(self, engine: str) -> None:
        """``engine`` left (or a new server took its name): nothing it held is known any more."""
        for index in self.indexes.values():
            index.clear(engine)

    def on_moved(self, session_id: str, engine: str) -> None:
        """The session was re-homed on ``engine`` between turns."""
        self.homes.moved(session_id, engine)

    # -- between turns ---------------------------------------------------------------------------
    def plan(
        self,
        outcome: TurnOutcome,
        engines: tuple[EngineView, ...],
        index: IndexKind,
        hashes: list[int],
        params: PlannerParams,
        now: float,
    ) -> PlanAction:
        """Where the session's KV should be for its next turn (:func:`~gateway.core.planner.
        plan_turn`), after its turn settled (:meth:`on_finished`'s write done): the homes learn
        when it is expected back (``now + outcome.gap_s``) and project each engine's decode KV
        then; its next context is its last plus its last growth. A ``knee_ahead`` move is in
        flight in :attr:`moves` until the caller reports :meth:`move_ended` (done, failed or
        cancelled; cancel the session's previous migration before planning)."""
        sid = outcome.session_id
        nxt = self.homes.next_tokens(sid)
        if nxt > 0:
            outcome = replace(outcome, next_tokens=nxt)
        back = now + outcome.gap_s
        self.homes.expect(sid, back)
        expected = self.homes.expected_at(back, params.turn_s, exclude=sid)
        action, self.moves = plan_turn(
            outcome, self.views(engines, now), self.matches(index, hashes), params, self.moves, now, expected
        )
        return action

    def move_ended(self, session_id: str) -> None:
        """The session's move is over (done, failed or cancelled): its bounds are free."""
        self.moves = self.moves.finished(session_id)
