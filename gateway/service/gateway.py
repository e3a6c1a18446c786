"""The gateway service: the app's stateful parts wired together for the app's lifespan.

A generation request's life is the turn pipeline's (:mod:`.turns`), which orders the stages this
class owns: :meth:`analyze` (:mod:`.prompts`, then the routing core's reading through
:mod:`.placement`), :meth:`decide`, admission (:mod:`.admission`), the placement's commit and
settlement, :meth:`open` (:mod:`.forwarding`), and in the background :mod:`.kv_events`,
:mod:`.migrations`, :mod:`.rehome`. Errors are domain errors (:mod:`.errors`); the edge maps them
to HTTP.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Any

from gateway.config import GatewayConfig
from gateway.core.kv_hints import kv_transfer_params
from gateway.core.router import Router
from gateway.core.sessions import SessionRecord
from gateway.core.types import Decision, PrefixMatch
from gateway.errors import ResponseNotFound, UpstreamFailed
from gateway.service.admission import Admission, TenantPass
from gateway.service.cluster import Cluster
from gateway.service.forwarding import Forwarder, Relay
from gateway.service.kv_events import KvEventFeeds, KvEventSubscriber
from gateway.service.membership import Membership
from gateway.service.metrics import GatewayMetrics
from gateway.service.migrations import MigrationExecutor
from gateway.service.placement import Analysis, Placement
from gateway.service.prompts import Prompts
from gateway.service.proxy import Upstream
from gateway.service.rehome import Rehomer
from gateway.service.responses import engine_search
from gateway.service.roles import RoleDriver, role_params
from gateway.service.session_store import RedisSessionStore, SessionStore
from gateway.service.shared_load import SharedLoad
from gateway.service.tenants import ANONYMOUS, Tenant, TenantRegistry
from gateway.service.turns import Turns
from gateway.wire.openai import ParsedRequest

__all__ = ["Analysis", "GatewayService", "Relay"]

SEARCH_TIMEOUT_S = 10.0
"""How long a search of the engines for a stored response waits for their answers."""


def salt_for(parsed: ParsedRequest, salt: str) -> None:
    """Give the request the tenant's prefix-cache salt, whatever the client sent: the body the
    engine gets and the prompt the gateway hashes."""
    parsed.body["cache_salt"] = salt
    if parsed.prompt is not None:
        parsed.prompt["cache_salt"] = salt


class GatewayService:
    def __init__(
        self,
        config: GatewayConfig,
        upstream: Upstream,
        cluster: Cluster,
        router: Router,
        metrics: GatewayMetrics,
        sessions: SessionStore,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.config = config
        self.upstream = upstream
        self.cluster = cluster
        self.router = router
        self.metrics = metrics
        self.sessions = sessions
        self.clock = clock
        kv_events = any(s.config.kv_events for s in cluster.engines.values())
        self.prompts = Prompts(config, kv_events, metrics)
        self.migrations = MigrationExecutor(
            config.migration, upstream.http, cluster, sessions, metrics, clock
        )
        self.placement = Placement(
            config, cluster, router, sessions, self.migrations, self.prompts, metrics, clock
        )
        self.rehomer = Rehomer(cluster, self.placement, metrics, clock)
        self.forwarder = Forwarder(config, upstream, cluster, metrics)
        if config.sessions.discover_response_owners and not config.auth.tenants:
            owners = self.placement.owners
            owners.find = engine_search(self._may_hold_responses, self.forwarder.call, SEARCH_TIMEOUT_S)
            owners.on_search = lambda outcome: metrics.response_owner_searches.labels(outcome).inc()
        self.tenants = TenantRegistry.from_config(config.auth, config.listen.host, announce=False)
        self.admission = Admission(config.admission, metrics=metrics)
        self.turns = Turns(self, self.admission, self.placement, self.forwarder, cluster, metrics)
        """The turn pipeline: a generation request's life, stage by stage."""
        self.kv_feeds = KvEventFeeds(self.placement.index)
        """The engines' KV events into the prefix index."""
        self.roles = (
            RoleDriver(cluster, role_params(config.routing)) if config.routing.role_controller else None
        )
        self.shared_load: SharedLoad | None = None
        """The other replicas' in-flight ledgers, shared through Redis (gateway/service/shared_load.py)."""
        period = config.sessions.share_load_s
        if isinstance(sessions, RedisSessionStore) and period > 0:
            self.shared_load = SharedLoad(
                sessions.redis, cluster.load, period, sessions.prefix, cluster.refresh
            )
            cluster.shared = self.shared_load.of
        self.membership = Membership(
            config, cluster, self.placement, self.prompts, self.rehomer, self.kv_feeds, metrics
        )
        """Engines joining and leaving while it runs (SIGHUP, admin API, discovery file)."""

    @property
    def index(self) -> Any:
        """The prefix index fed by the engines' KV events."""
        return self.placement.index

    @property
    def subscribers(self) -> list[KvEventSubscriber]:
        """Each publishing engine's KV-event subscriber (its coverage: ``/ready``, ``/metrics``)."""
        return self.kv_feeds.subscribers

    def _may_hold_responses(self) -> list[tuple[str, str]]:
        """The engines a stored response may be on: answered since the gateway started, not
        removed, not refusing connections (bounded by the fleet)."""
        return [
            (n, s.pool) for n, s in self.cluster.engines.items() if s.seen and not s.removed and not s.refused
        ]

    # -- lifecycle -----------------------------------------------------------------------------
    def start(self) -> None:
        self.cluster.on_eject.append(self.rehomer.engine_ejected)
        if self.roles is not None:
            self.roles.start()
        self.kv_feeds.start({s.name: s.config.kv_events for s in self.cluster.engines.values()})
        self.membership.start()
        self.sessions.start()
        if self.shared_load is not None:
            self.shared_load.start()

    async def stop(self) -> None:
        if self.shared_load is not None:
            await self.shared_load.stop()
        await self.membership.stop()
        if self.roles is not None:
            await self.roles.stop()
        if self.rehomer.engine_ejected in self.cluster.on_eject:
            self.cluster.on_eject.remove(self.rehomer.engine_ejected)
        await self.rehomer.stop()
        await self.prompts.aclose()
        await self.migrations.stop()
        await self.kv_feeds.stop()
        await self.sessions.close()

    # -- a turn ----------------------------------------------------------------------------------
    async def analyze(
        self,
        parsed: ParsedRequest,
        headers: Sequence[tuple[bytes, bytes]],
        dry_run: bool = False,
        tenant: Tenant = ANONYMOUS,
    ) -> Analysis:
        """Read-only: what is known about the request (``dry_run``: not counted as a request).
        Every id is the tenant's (namespaced), and so is the prefix-cache salt."""
        tenant.check_model(parsed.model)
        if tenant.cache_salt is not None:
            salt_for(parsed, tenant.cache_salt)
        prompt = await self.prompts.read(parsed, headers, dry_run, tenant)
        prev = parsed.previous_response_id
        stored = tenant.namespace(prev) if prev is not None else None
        return await self.placement.analyze(prompt, stored, prev)

    def decide(self, a: Analysis) -> Decision:
        return self.placement.decide(a)

    def pin_for(self, a: Analysis, d: Decision) -> dict[str, Any] | None:
        """engine_ext's ``kv_transfer_params`` for this turn
        (:func:`~gateway.core.kv_hints.kv_transfer_params`): pin the session's KV at the end of
        the request for the expected gap, or release it at the session's end; as a KV hint
        envelope action when the engine reads them (its ``kv_hints``)."""
        h = a.hints
        if h.session_id is None or not self.migrations.controllable(d.engine):
            return None
        ttl = None
        if not h.session_end:
            ttl = self.migrations.params.pin_ttl_s(self.placement.expected_gap(h, a.record))
            if h.kv_retention_ttl_s is not None:
                ttl = h.kv_retention_ttl_s
        turn = (a.record.turns if a.record is not None else 0) + 1
        return kv_transfer_params(
            h.session_id,
            ttl,
            h.session_end,
            f"{h.session_id}#{turn}",
            self.migrations.carries_hints(d.engine),
        )

    async def open(
        self,
        decision: Decision,
        path: str,
        body: bytes,
        headers: Sequence[tuple[bytes, bytes]],
        stream: bool = False,
        continues: str | None = None,
    ) -> Relay:
        """``continues``: the stored response the request continues (``previous_response_id``).
        Its engine is the only one that can answer; when that engine cannot be reached (killed:
        the response lived in its memory), the answer is OpenAI's 404 for an unknown id, naming
        ``previous_response_id``, never another engine's answer without the history."""
        try:
            return await self.forwarder.open(decision, path, body, headers, stream)
        except UpstreamFailed as exc:
            if continues is None or decision.reason != "owner" or not exc.connect:
                raise
            # a paused engine times out before its probes fail: the response may still exist
            self.cluster.owner_unavailable(decision.engine, "previous_response_id", exc.timed_out)
            why = f"the engine that stored it, '{decision.engine}', cannot be reached"
            raise ResponseNotFound(continues, "previous_response_id", why) from None

    async def remember_response(self, response_id: str, up: Relay, tenant: Tenant) -> None:
        """The engine of ``up`` stored the tenant's response ``response_id``."""
        await self.placement.owners.remember(tenant.namespace(response_id), up.engine, up.pool)

    async def call_owner(
        self, response_id: str, method: str, path: str, tenant: Tenant = ANONYMOUS
    ) -> tuple[int, bytes]:
        """A call on a stored response of the tenant's, made on the engine that holds it."""
        found = await self.placement.owners.lookup(tenant.namespace(response_id), "response_id")
        owner, since = found if found is not None else (None, None)
        state = self.cluster.engines.get(owner) if owner is not None else None
        if owner is not None and state is not None and not state.healthy:
            # not answering now, or back since this replica saw it refuse: a 503 to retry
            self.cluster.owner_unavailable(owner, "response_id", stored_at=since)
        if owner is None or state is None or not state.healthy:
            why = None if state is None else f"the engine that stored it, '{owner}', is gone"
            raise ResponseNotFound(response_id, "response_id", why)
        try:
            return await self.forwarder.call(owner, method, path, None)
        except UpstreamFailed as exc:
            self.cluster.owner_unavailable(owner, "response_id", exc.timed_out)
            if not exc.connect:
                raise
            why = f"the engine that stored it, '{owner}', cannot be reached"
            raise ResponseNotFound(response_id, "response_id", why) from None

    def enter(self, tenant: Tenant, declared_bytes: int | None) -> TenantPass:
        """Count a request that is not a session turn against its tenant's concurrency and
        request rate before its body is read, as a turn is (raises Refused, a 429; the pass is
        held until :meth:`TenantPass.leave`)."""
        return self.admission.enter_body(tenant, declared_bytes)

    async def forward_once(
        self,
        parsed: ParsedRequest,
        path: str,
        raw: bytes,
        headers: Sequence[tuple[bytes, bytes]],
        entered: TenantPass,
    ) -> tuple[int, bytes]:
        """A request that is not a session turn (token counting): routed as a dry run, admitted
        as a turn is (the gateway's slots, then the engine's; interactive first), sent, answered
        whole. ``entered``: its tenant's pass (:meth:`enter`). It generates nothing, so its
        tokens are not debited from the tenant's token rate (the estimate is refunded)."""
        tenant = entered.tenant
        await self.admission.turnstile.enter()
        a = await self.analyze(parsed, headers, dry_run=True, tenant=tenant)
        d = self.decide(a)
        interactive = a.hints.interactive
        async with (
            self.admission.admit(tenant, interactive, 0, entered=entered),
            self.admission.engine_slot(d.engine, interactive, tenant),
        ):
            return await self.forwarder.call(d.engine, "POST", path, raw)

    # -- sessions ------------------------------------------------------------------------------
    async def session(self, session_id: str) -> SessionRecord | None:
        """The (stored) session's record, None when it is not known."""
        return await self.sessions.get(session_id, self.clock())

    def migration(self, session_id: str) -> dict[str, object] | None:
        """The session's current or last planned move, as the session API shows it."""
        m = self.migrations.current.get(session_id)
        return m.to_dict() if m is not None else None

    # -- operator views --------------------------------------------------------------------------
    async def readiness(self, now: float) -> dict[str, Any]:
        """What ``/ready`` reports (without the drain, which is the edge's): each pool's
        readiness, whether the shared session store is down, the engines routing skips and why,
        and how stale each engine's part of the prefix index may be."""
        return {
            "pools": self.cluster.ready(),
            "degraded": await self.sessions.probe(),  # a shared store down: routing on the local view
            "waiting_for": self.cluster.waiting(),
            "prefix_index": {sub.engine: sub.coverage(now) for sub in self.subscribers},
        }

    async def metrics_text(self, now: float) -> bytes:
        """The Prometheus exposition, its gauges of engines, pools, the store and the index
        refreshed first."""
        m = self.metrics
        for name, s in self.cluster.engines.items():
            m.engine_healthy.labels(name).set(1 if s.healthy else 0)
            m.inflight.labels(name).set(s.inflight)
        for pool, panic in self.cluster.panicking().items():
            m.engine_panic.labels(pool).set(1 if panic else 0)
        m.session_store_degraded.set(1 if await self.sessions.probe() else 0)
        for sub in self.subscribers:
            cov = sub.coverage(now)
            m.index_coverage.labels(sub.engine).set(cov["complete_for_s"])
            m.kv_event_gaps.labels(sub.engine).set(cov["gaps"])
        return m.render()

    async def end_session(self, session_id: str) -> SessionRecord | None:
        return await self.placement.end_session(session_id)

    async def update_hints(self, session_id: str, hints: Any) -> SessionRecord:
        return await self.placement.update_hints(session_id, hints)

    def session_matches(self, rec: SessionRecord, model: str | None = None) -> dict[str, PrefixMatch]:
        return self.placement.session_matches(rec, model)
