"""Placement: where a turn goes and what the session remembers of it. Drives the routing core
(:class:`gateway.core.routing.RoutingCore`, which owns the prefix indexes, the homes and the
in-flight subagents) with the live state: the session store's records (read before a turn
arrives, written through the core's read-modify-writes) and the engines' views; after a turn,
asks the planner where the session's KV should be for the next one and hands that to the
migration executor.

Decide and update are separate: :meth:`Placement.analyze` and :meth:`Placement.decide` only
read (``/debug/route`` uses them as they are); :meth:`place` and :meth:`settle` write.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

from gateway.config import GatewayConfig
from gateway.core.hints import AgentHints
from gateway.core.planner import ActionKind, PlanAction, TurnOutcome, with_knee
from gateway.core.prefix_index import PrefixIndex
from gateway.core.router import NoEngine, Router, engine_cost
from gateway.core.routing import GATEWAY_RECENCY_SLACK, Arrival, RoutingCore, Write
from gateway.core.sessions import SessionRecord
from gateway.core.turn import IndexKind, Turn, index_for, predicted_misses, restarts
from gateway.core.types import Decision, PrefixMatch, RouteRequest, Snapshot
from gateway.errors import ModelNotFound, NoCapacity, ResponseNotFound
from gateway.service.cluster import Cluster
from gateway.service.metrics import GatewayMetrics
from gateway.service.migrations import MigrationExecutor
from gateway.service.prompts import PromptRead, Prompts
from gateway.service.responses import ResponseOwners
from gateway.service.session_store import SessionStore

__all__ = ["Analysis", "Placement"]


@dataclass(slots=True)
class Analysis:
    """Everything known about a request before deciding."""

    prompt: PromptRead
    arrival: Arrival
    owner: str | None = None
    """The one engine that can serve the turn (it holds the stored response it continues)."""
    owner_of: str | None = None
    """That stored response's id, as the client named it (for its error messages: the stored,
    namespaced id is the gateway's own)."""
    owner_since: float | None = None
    """When a replica recorded that the owner stored it."""
    store_local: bool = False
    """The session store was degraded: the turn was placed on this replica's local view, which
    lacks the sessions other replicas served (``x-agentgw-session-store: local``)."""

    @property
    def hints(self) -> AgentHints:
        return self.prompt.turn.hints

    @property
    def turn(self) -> Turn:
        return self.prompt.turn

    @property
    def request(self) -> RouteRequest:
        return self.arrival.request

    @property
    def snapshot(self) -> Snapshot:
        return self.arrival.snapshot

    @property
    def record(self) -> SessionRecord | None:
        return self.arrival.record


class Placement:
    """The routing core (:class:`~gateway.core.routing.RoutingCore`) over the live state: the
    session store's records, the engines' views, the migration executor."""

    def __init__(
        self,
        config: GatewayConfig,
        cluster: Cluster,
        router: Router,
        sessions: SessionStore,
        migrations: MigrationExecutor,
        prompts: Prompts,
        metrics: GatewayMetrics,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.config = config
        self.cluster = cluster
        self.router = router
        self.sessions = sessions
        self.migrations = migrations
        self.prompts = prompts
        self.metrics = metrics
        self.clock = clock
        self.core = RoutingCore(
            router, config.routing.index_capacity_blocks, recency_slack=GATEWAY_RECENCY_SLACK
        )
        self.owners = ResponseOwners(sessions, clock)
        rp = router.params
        knee = engine_cost(rp).decode_knee(rp.interactivity_tok_s) if rp.interactivity_tok_s > 0 else 1.0
        self.planner_params = with_knee(migrations.params, knee)
        """The planner's parameters with the router's decode knee (``knee_ahead`` moves)."""
        migrations.on_rehome = self.core.on_moved
        migrations.on_move_end = self.core.move_ended

    @property
    def index(self) -> PrefixIndex:
        """The index fed by the engines' KV events."""
        return self.core.index

    # -- reading -------------------------------------------------------------------------------
    async def analyze(
        self, prompt: PromptRead, continues: str | None = None, shown: str | None = None
    ) -> Analysis:
        """``continues``: the (stored) id of a stored response the turn continues (its engine
        only); ``shown``: that id as the client named it, for error messages."""
        shown = shown if shown is not None else continues
        turn = prompt.turn
        h = turn.hints
        # the owner first: its lookup may wait (a store pushing back, a search of the engines),
        # and the engines' views are read after every wait: a view older than the owner's
        # re-admission made a healthy owner look gone (not found, the chain ended)
        found = await self.owners.lookup(continues) if continues is not None else None
        if continues is not None and found is None:
            raise ResponseNotFound(shown or "", "previous_response_id")
        owner, since = found if found is not None else (None, None)
        now = self.clock()
        rec = await self.sessions.get(h.session_id, now) if h.session_id else None
        parent = None
        if h.parent_session_id is not None:
            parent = await self.sessions.get(h.parent_session_id, now)
        arrival = self.core.on_arrival(turn, prompt.index, rec, parent, self.cluster.views(), now)
        local = h.session_id is not None and self.sessions.degraded
        return Analysis(prompt, arrival, owner, shown, since, local)

    def decide(self, a: Analysis) -> Decision:
        if a.owner is not None:
            d = self.core.owner(a.arrival, a.owner)
            if d is None:
                # not answering now, or back since this replica saw it refuse: a 503 to retry
                self.cluster.owner_unavailable(a.owner, "previous_response_id", stored_at=a.owner_since)
                # its engine is gone (refusing connections, or removed), and the history with it
                raise ResponseNotFound(a.owner_of or "", "previous_response_id")
            return d
        try:
            return self.core.decide(a.arrival)
        except NoEngine as exc:
            if exc.reason == "unknown_model":
                raise ModelNotFound(str(exc)) from None
            message = str(exc)
            starting = self.cluster.starting()
            if starting and not any(self.cluster.ready().values()):  # a gateway started before its engines
                message += f": engines starting ({', '.join(starting)}); GET /ready says when they are up"
            raise NoCapacity(message, self.config.limits.retry_after_s) from None

    def session_matches(self, rec: SessionRecord, model: str | None = None) -> dict[str, PrefixMatch]:
        """Where the session's last prompt is cached. Its hashes are exact when its model has a
        tokenizer (and KV events feed the precise index) and its turns were analysed exactly,
        else approximate."""
        model = model or rec.model
        exact = model is not None and self.prompts.exact_for(model) and rec.hashes_exact is not False
        return self.core.matches(index_for(exact, self.prompts.kv_events), rec.prefix_hashes)

    # -- writing -------------------------------------------------------------------------------
    async def _write(self, writes: list[Write], now: float) -> None:
        for w in writes:
            w.done(await self.sessions.update(w.session_id, now, w.apply))

    async def place(self, a: Analysis, d: Decision) -> None:
        """Record the admitted turn's decision: the approximate index learns where the prefix
        went, the session its new home and its prompt's tokens (for a KV prefetch), the parent
        its child, the fan-out its in-flight sibling. The one place a turn writes before it is
        forwarded: analysis and decision only read, so a refused turn leaves all of it as it was."""
        rp = self.core.router.params
        self.metrics.count_decision(
            d.profile, d.pool, d.reason, predicted_misses(d, rp.slo_ttft_ms, rp.interactivity_tok_s)
        )
        sid = a.hints.session_id
        if sid is not None and a.prompt.tokens:
            self.prompts.remember(sid, a.prompt.tokens)
        if sid is not None and restarts(a.record, a.turn):
            self.metrics.session_restarts.inc()
        if sid is not None and sid in self.migrations.current:
            frac = d.cached_tokens / a.request.prompt_tokens if a.request.prompt_tokens else 0.0
            self.migrations.on_next_turn(sid, d.engine, frac)
        now = self.clock()
        await self._write(self.core.on_routed(a.arrival, d, now), now)

    async def settle(self, a: Analysis, d: Decision, served_on: str | None, ok: bool) -> None:
        """The turn is over (``served_on``: the engine that answered, None if none did)."""
        now = self.clock()
        writes = self.core.on_finished(a.arrival, d, served_on, ok, now)
        h = a.hints
        if h.session_id is None:
            return
        # the request carried its pin or release as a KV hint envelope, and the engine that
        # served it reads them (GatewayService.pin_for)
        carried = (
            served_on is not None
            and self.migrations.carries_hints(d.engine)
            and self.migrations.carries_hints(served_on)
        )
        if h.session_end:
            await self.end_session(h.session_id, released_on=served_on if carried else None)
            return
        for w in writes:
            rec = await self.sessions.update(w.session_id, now, w.apply)
            w.done(rec)
            if rec is not None and ok and served_on is not None:
                self.after_turn(rec, h, served_on, a.turn.model, a.prompt.index, carried)

    def expected_gap(self, hints: AgentHints, rec: SessionRecord | None) -> float:
        hinted = hints.expected_tool_latency_ms / 1000 if hints.expected_tool_latency_ms is not None else None
        return self.planner_params.gap_s(hinted, rec.expected_gap() if rec is not None else None)

    def after_turn(
        self,
        rec: SessionRecord,
        hints: AgentHints,
        engine: str,
        model: str,
        index: IndexKind,
        carried: bool = False,
    ) -> PlanAction | None:
        """Plan where the session's KV should be for its next turn, and start doing it
        (``carried``: the turn's request to ``engine`` pinned the session there already)."""
        if not self.migrations.controllable(engine):
            return None
        sid, now = rec.session_id, self.clock()
        outcome = TurnOutcome(
            session_id=sid,
            home=engine,
            context_tokens=rec.context_tokens,
            gap_s=self.expected_gap(hints, rec),
            fan_out=hints.fan_out or 0,
            is_subagent=hints.is_subagent,
            block_size=self.prompts.block_size(model),
        )
        self.migrations.cancel(sid, reason="new_plan")  # first: its move bounds are freed
        action = self.core.plan(
            outcome, self.cluster.views(), index, rec.prefix_hashes, self.planner_params, now
        )
        if self.migrations.submit(action, self.prompts.session_tokens(sid), carried) is None:
            self.core.move_ended(sid)
        return action

    async def end_session(self, session_id: str, released_on: str | None = None) -> SessionRecord | None:
        """The session is over: cancel pending migrations, release its pins, forget it
        (``released_on``: the engine whose pins the last turn's request released already)."""
        self.migrations.cancel(session_id, reason="session_end")
        rec = await self.sessions.delete(session_id)
        self.prompts.forget(session_id)
        self.core.on_ended(session_id)
        if rec is not None and rec.home is not None and self.migrations.controllable(rec.home):
            self.migrations.submit(
                PlanAction(ActionKind.RELEASE, session_id, rec.home, reason="session_end"),
                None,
                carried=rec.home == released_on,
            )
        return rec

    async def update_hints(self, session_id: str, hints: AgentHints) -> SessionRecord:
        now = self.clock()

        def apply(rec: SessionRecord | None) -> SessionRecord:
            rec = rec or SessionRecord(session_id, created=now, last_activity=now)
            if hints.expected_tool_latency_ms is not None:
                rec.expected_gap_s = hints.expected_tool_latency_ms / 1000
            if hints.parent_session_id is not None:
                rec.parent = hints.parent_session_id
            rec.last_activity = now
            return rec

        rec = await self.sessions.update(session_id, now, apply)
        assert rec is not None  # apply always returns a record
        return rec
