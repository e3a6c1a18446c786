"""The gateway service: turns a parsed request into a routing decision (hints, session, exact
prompt block hashes, prefix matches, engine load), opens the upstream stream with one retry on a
connection failure, and records the outcome (session placement, turn history).

Decide and update are separate: :meth:`GatewayService.decide` only reads (it also serves the
``/debug/route`` dry run); :meth:`GatewayService.plan` decides, then updates the session table and
the approximate index; :meth:`GatewayService.finish` records what happened.
"""

from __future__ import annotations

import itertools
import logging
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import aiohttp
import orjson
import zmq.asyncio
from multidict import CIMultiDict

from gateway.config import GatewayConfig
from gateway.core.hints import (
    GATEWAY_BODY_KEYS,
    HEADER_NAMES,
    HINT_HEADERS,
    AgentHints,
    HintError,
    parse_hints,
)
from gateway.core.planner import ActionKind, PlanAction, TurnOutcome, plan_after_turn
from gateway.core.prefix_index import PrefixIndex
from gateway.core.router import NoEngine, Router
from gateway.core.sessions import SessionRecord
from gateway.core.types import Decision, PrefixMatch, RouteRequest, SessionView, Snapshot
from gateway.errors import ApiError
from gateway.protocol import ParsedRequest
from gateway.service.analysis import AnalysisSkipped, PromptAnalyzer
from gateway.service.cluster import Cluster
from gateway.service.kv_events import KvEventSubscriber
from gateway.service.metrics import GatewayMetrics
from gateway.service.migrations import MigrationExecutor
from gateway.service.proxy import CONNECT_ERRORS, HOP_HEADERS, Upstream
from gateway.service.session_store import SessionStore
from gateway.service.tokenize import ChatTokenizer

log = logging.getLogger("agentgw.gateway")

_HINT_HEADER_BYTES = frozenset(h.encode() for h in HEADER_NAMES)
_DROP_HEADERS = HOP_HEADERS | {b"content-type"} | {h.encode() for h in HINT_HEADERS}
MAX_SIBLING_PARENTS = 10_000


@dataclass(slots=True)
class Relay:
    """An open upstream response being relayed."""

    engine: str
    pool: str
    response: aiohttp.ClientResponse
    retried: bool


@dataclass(slots=True)
class Analysis:
    """Everything known about a request before deciding."""

    hints: AgentHints
    request: RouteRequest
    snapshot: Snapshot
    hashes: list[int]
    exact: bool
    """True when tokens and hashes are exact (a tokenizer is configured for the model)."""
    record: SessionRecord | None
    warning: str | None = None
    parent: SessionRecord | None = None


@dataclass(slots=True)
class Plan:
    """Where a parsed request goes and what is sent there."""

    decision: Decision
    body: bytes
    headers: list[tuple[bytes, bytes]]
    analysis: Analysis
    extra_headers: list[tuple[bytes, bytes]] = field(default_factory=list)

    def response_headers(self, up: Relay) -> list[tuple[bytes, bytes]]:
        d = self.decision
        reason = d.reason if not up.retried else "retry"
        out = [
            (b"x-agentgw-engine", up.engine.encode()),
            (b"x-agentgw-pool", up.pool.encode()),
            (b"x-agentgw-reason", reason.encode()),
            (b"x-agentgw-cached-tokens-est", str(d.cached_tokens).encode()),
        ]
        sid = self.analysis.hints.session_id
        if sid is not None:
            out.append((b"x-agentgw-session", sid.encode()))
        return out + self.extra_headers


def decision_dict(d: Decision) -> dict[str, Any]:
    return {
        "engine": d.engine,
        "pool": d.pool,
        "reason": d.reason,
        "profile": d.profile,
        "cached_tokens_est": d.cached_tokens,
        "uncached_tokens_est": d.uncached_tokens,
        "candidates": [
            {"engine": c.engine, "pool": c.pool, "total": round(c.total, 6), "scores": c.scores}
            for c in d.candidates
        ],
        "fallbacks": list(d.fallbacks),
    }


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
        self._seq = itertools.count()
        cap = config.routing.index_capacity_blocks
        self.index = PrefixIndex(cap)
        self.approx = PrefixIndex(cap)
        self.tokenizers: dict[str, ChatTokenizer] = {
            m.name: ChatTokenizer(m.tokenizer, m.block_size, m.hash_seed)
            for m in config.models
            if m.tokenizer
        }
        self.block_sizes = {m.name: m.block_size for m in config.models}
        self.analyzer = PromptAnalyzer(config.models, config.analysis, metrics)
        self._siblings: dict[str, Counter[str]] = {}
        self._zmq: zmq.asyncio.Context | None = None
        self.subscribers: list[KvEventSubscriber] = []
        self.migrations = MigrationExecutor(
            config.migration, upstream.http, cluster, sessions, metrics, clock
        )

    # -- lifecycle -----------------------------------------------------------------------------
    def start(self) -> None:
        self._zmq = zmq.asyncio.Context()
        for s in self.cluster.engines.values():
            if s.config.kv_events:
                sub = KvEventSubscriber(self._zmq, self.index, s.name, s.config.kv_events)
                sub.start()
                self.subscribers.append(sub)

    async def stop(self) -> None:
        await self.analyzer.aclose()
        await self.migrations.stop()
        for sub in self.subscribers:
            await sub.stop()
        if self._zmq is not None:
            self._zmq.term()
        await self.sessions.close()

    # -- deciding ------------------------------------------------------------------------------
    def _approx_hashes(self, parsed: ParsedRequest) -> list[int]:
        """Approximate prefix blocks: a hash chain over fixed-size chunks of the prompt text."""
        body = parsed.body
        if parsed.kind == "chat":
            parts = []
            for m in body["messages"]:
                c = m.get("content")
                if isinstance(c, list):
                    c = "\n".join(p.get("text", "") for p in c if isinstance(p, dict))
                parts.append(f"<{m.get('role')}>{c if isinstance(c, str) else ''}")
            text = "".join(parts)
        else:
            p = body["prompt"]
            text = p if isinstance(p, str) else orjson.dumps(p).decode()
        size = self.config.routing.approx_chunk_chars
        out, h = [], 0
        for i in range(0, len(text) - size + 1, size):
            h = hash((h, text[i : i + size]))
            out.append(h)
        return out

    async def analyze(self, parsed: ParsedRequest, headers: Sequence[tuple[bytes, bytes]]) -> Analysis:
        hdrs = {}
        for k, v in headers:
            if k in _HINT_HEADER_BYTES:
                hdrs[k.decode("latin-1")] = v.decode("latin-1")
        warning = None
        try:
            hints = parse_hints(hdrs, parsed.body)
        except HintError as exc:
            if self.config.hints.on_invalid == "reject":
                raise ApiError(400, str(exc), exc.field, "invalid_hint") from None
            hints, warning = AgentHints(), str(exc)
        now = self.clock()
        sid = hints.session_id
        rec = await self.sessions.get(sid, now) if sid else None
        if rec is not None and rec.ended:
            rec = None
        try:
            info = await self.analyzer.analyze(parsed.model, parsed.kind, parsed.body, sid)
        except AnalysisSkipped:
            info = None  # counted by the analyzer; route on the approximate index
        if info is not None:
            n_tokens, hashes, index = info.num_tokens, info.hashes, self.index
            block_size = self.analyzer.block_sizes[parsed.model]
        else:
            hashes = self._approx_hashes(parsed)
            n_tokens = parsed.text_chars // 4
            block_size, index = max(1, self.config.routing.approx_chunk_chars // 4), self.approx
        matches = index.match(hashes)
        parent_home, parent_matches, parent = None, {}, None
        parent_id = hints.parent_session_id
        if parent_id is not None:
            parent = await self.sessions.get(parent_id, now)
            if parent is not None:
                parent_home = parent.home
                parent_matches = index.match(parent.prefix_hashes)
        session_view = None
        if sid is not None:
            session_view = SessionView(
                session_id=sid,
                home=rec.home if rec else None,
                pool=rec.pool if rec else None,
                turns=rec.turns if rec else 0,
                context_tokens=rec.context_tokens if rec else 0,
                parent_home=parent_home,
            )
        req = RouteRequest(
            model=parsed.model,
            prompt_tokens=n_tokens,
            block_size=block_size,
            session_id=sid,
            parent_session_id=parent_id,
            is_subagent=hints.is_subagent,
            fan_out=hints.fan_out or 0,
            interactive=hints.interactive,
            priority=hints.priority,
            seq=next(self._seq),
        )
        siblings = dict(self._siblings.get(parent_id, {})) if parent_id else {}
        snap = Snapshot(
            engines=self.cluster.views(),
            matches=matches,
            session=session_view,
            parent_matches=parent_matches,
            siblings=siblings,
        )
        return Analysis(hints, req, snap, hashes, info is not None, rec, warning, parent)

    def decide(self, a: Analysis) -> Decision:
        try:
            return self.router.route(a.request, a.snapshot)
        except NoEngine as exc:
            if exc.reason == "unknown_model":
                raise ApiError(404, str(exc), "model", "model_not_found") from None
            raise ApiError(
                503, str(exc), None, "no_healthy_engine", retry_after=self.config.limits.retry_after_s
            ) from None

    # -- deciding + updating -------------------------------------------------------------------
    async def plan(self, parsed: ParsedRequest, raw: bytes, headers: Sequence[tuple[bytes, bytes]]) -> Plan:
        a = await self.analyze(parsed, headers)
        d = self.decide(a)
        self.metrics.count_decision(d.profile, d.pool, d.reason)
        if not a.exact:
            self.approx.apply_stored(d.engine, a.hashes)
        sid = a.hints.session_id
        if sid is not None and sid in self.migrations.current:
            frac = d.cached_tokens / a.request.prompt_tokens if a.request.prompt_tokens else 0.0
            self.migrations.on_next_turn(sid, d.engine, frac)
        await self._place(a, d)
        body = self._forward_body(parsed, raw, a.hints, d.engine, a.record)
        fwd = [(k, v) for k, v in headers if k not in _DROP_HEADERS]
        fwd.append((b"content-type", b"application/json"))
        extra = [(b"x-agentgw-warning", a.warning.encode("latin-1", "replace"))] if a.warning else []
        return Plan(d, body, fwd, a, extra)

    async def _place(self, a: Analysis, d: Decision) -> None:
        h = a.hints
        if h.session_id is None:
            return
        now = self.clock()
        sid, parent_id = h.session_id, h.parent_session_id

        def place(rec: SessionRecord | None) -> SessionRecord:
            if rec is None or rec.ended:
                rec = SessionRecord(sid, created=now, last_activity=now)
            rec.home, rec.pool = d.engine, d.pool
            rec.parent = parent_id or rec.parent
            rec.inflight += 1
            rec.cached_tokens_est = d.cached_tokens
            if h.expected_tool_latency_ms is not None:
                rec.expected_gap_s = h.expected_tool_latency_ms / 1000
            rec.last_decision = decision_dict(d)
            return rec

        await self.sessions.update(sid, now, place)
        if parent_id is not None:
            if a.parent is not None and sid not in a.parent.children:

                def adopt(parent: SessionRecord | None) -> SessionRecord | None:
                    if parent is None or sid in parent.children:
                        return None
                    parent.add_child(sid)
                    return parent

                await self.sessions.update(parent_id, now, adopt)
            sib = self._siblings.setdefault(parent_id, Counter())
            sib[d.engine] += 1
            if len(self._siblings) > MAX_SIBLING_PARENTS:
                self._siblings.pop(next(iter(self._siblings)))

    def _forward_body(
        self,
        parsed: ParsedRequest,
        raw: bytes,
        hints: AgentHints,
        engine: str,
        rec: SessionRecord | None,
    ) -> bytes:
        body = parsed.body
        changed = False
        if (
            hints.session_id is not None
            and self.migrations.controllable(engine)
            and "kv_transfer_params" not in body
        ):
            # engine_ext pins the session's KV at the end of this request for the expected gap
            gap = self._expected_gap(hints, rec)
            ttl = min(gap + self.config.migration.pin_margin_s, self.config.migration.max_pin_s)
            if hints.kv_retention_ttl_s is not None:
                ttl = hints.kv_retention_ttl_s
            agentgw = {"session_id": hints.session_id, "pin_ttl_s": ttl}
            if hints.session_end:
                agentgw = {"session_id": hints.session_id, "release": True}
            body = {**body, "kv_transfer_params": {"agentgw": agentgw}}
            changed = True
        for key in GATEWAY_BODY_KEYS:
            if key in body:
                body = {k: v for k, v in body.items() if k != key}
                changed = True
        xargs = body.get("vllm_xargs")
        if isinstance(xargs, dict) and "agentic_context" in xargs:
            rest = {k: v for k, v in xargs.items() if k != "agentic_context"}
            body = (
                {**body, "vllm_xargs": rest} if rest else {k: v for k, v in body.items() if k != "vllm_xargs"}
            )
            changed = True
        if self.config.routing.forward_priority and hints.priority is not None and "priority" not in body:
            body = {**body, "priority": hints.priority}
            changed = True
        return orjson.dumps(body) if changed else raw

    # -- sending -------------------------------------------------------------------------------
    async def open(
        self, decision: Decision, path: str, body: bytes, headers: Sequence[tuple[bytes, bytes]]
    ) -> Relay:
        """Send the request; on a connection failure before any byte, retry once on another
        engine of the same pool, then give up with a 502."""
        tries = [decision.engine, *decision.fallbacks[:1]]
        hdrs = CIMultiDict((k.decode("latin-1"), v.decode("latin-1")) for k, v in headers)
        last: BaseException | None = None
        for i, name in enumerate(tries):
            state = self.cluster.engines[name]
            if i > 0 and not state.healthy:
                continue
            self.cluster.begin(name)
            try:
                response = await self.upstream.session.post(
                    state.config.url + path, data=body, headers=hdrs, timeout=self.upstream.timeout
                )
            except CONNECT_ERRORS as exc:
                self.cluster.end(name)
                self.cluster.record_connect_failure(name)
                self.metrics.upstream_errors.labels(name, "connect").inc()
                log.warning("connect to %s failed: %r", name, exc)
                last = exc
                continue
            except aiohttp.ClientError as exc:
                self.cluster.end(name)
                self.metrics.upstream_errors.labels(name, type(exc).__name__).inc()
                raise ApiError(
                    502, f"engine '{name}' failed before responding: {exc!r}", None, "upstream_error"
                ) from None
            return Relay(name, state.pool, response, retried=i > 0)
        raise ApiError(
            502,
            f"could not connect to any engine of pool '{decision.pool}': {last!r}",
            None,
            "upstream_connect_error",
        )

    async def abandon(self, plan: Plan) -> None:
        """The request was planned but never reached an engine."""
        await self._settle(plan, None, ok=False)

    async def finish(self, plan: Plan, up: Relay, status: str) -> None:
        self.cluster.end(up.engine)
        await self._settle(plan, up.engine, ok=status.startswith("2"))

    async def _settle(self, plan: Plan, engine: str | None, ok: bool) -> None:
        a = plan.analysis
        h = a.hints
        if h.parent_session_id is not None:
            sib = self._siblings.get(h.parent_session_id)
            if sib is not None:
                sib[plan.decision.engine] -= 1
                if sib[plan.decision.engine] <= 0:
                    del sib[plan.decision.engine]
                if not sib:
                    del self._siblings[h.parent_session_id]
        if h.session_id is None:
            return
        now = self.clock()
        planned = plan.decision.engine

        def settle(rec: SessionRecord | None) -> SessionRecord | None:
            if rec is None:
                return None
            rec.inflight = max(0, rec.inflight - 1)
            if engine is not None and engine != planned and rec.home == planned:
                rec.home = engine  # a retry moved it (and no newer placement did)
            if ok:
                rec.record_turn(now, a.request.prompt_tokens, a.hashes)
            return rec

        if h.session_end:
            await self.end_session(h.session_id)
            return
        rec = await self.sessions.update(h.session_id, now, settle)
        if rec is not None and ok and engine is not None:
            self.after_turn(rec, h, engine, parsed_model=a.request.model)

    def _expected_gap(self, hints: AgentHints, rec: SessionRecord | None) -> float:
        if hints.expected_tool_latency_ms is not None:
            return hints.expected_tool_latency_ms / 1000
        gap = rec.expected_gap() if rec is not None else None
        return gap if gap is not None else self.config.migration.default_gap_s

    def after_turn(
        self, rec: SessionRecord, hints: AgentHints, engine: str, parsed_model: str
    ) -> PlanAction | None:
        """Plan where the session's KV should be for its next turn, and start doing it."""
        if not self.migrations.controllable(engine):
            return None
        turn = TurnOutcome(
            session_id=rec.session_id,
            home=engine,
            context_tokens=rec.context_tokens,
            gap_s=self._expected_gap(hints, rec),
            fan_out=hints.fan_out or 0,
            is_subagent=hints.is_subagent,
            block_size=self.block_sizes.get(parsed_model, 128),
        )
        index = self.index if parsed_model in self.tokenizers else self.approx
        action = plan_after_turn(
            turn, self.cluster.views(), index.match(rec.prefix_hashes), self.migrations.params
        )
        tokens = self.analyzer.session_tokens(rec.session_id)
        self.migrations.submit(action, tokens)
        return action

    async def end_session(self, session_id: str) -> SessionRecord | None:
        """The session is over: cancel pending migrations, release its pins, forget it."""
        self.migrations.cancel(session_id, reason="session_end")
        rec = await self.sessions.delete(session_id)
        self.analyzer.forget(session_id)
        if rec is not None and rec.home is not None and self.migrations.controllable(rec.home):
            self.migrations.submit(
                PlanAction(ActionKind.RELEASE, session_id, rec.home, reason="session_end"), None
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

    def session_matches(self, rec: SessionRecord, model: str | None = None) -> dict[str, PrefixMatch]:
        index = self.index if self.tokenizers else self.approx
        return index.match(rec.prefix_hashes)
