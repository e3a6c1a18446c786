"""The gateway's Prometheus metrics, on a registry owned by the app (no global registry)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, ProcessCollector, generate_latest

_LAT_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)


class GatewayMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        # the standard process_* metrics: process_resident_memory_bytes (RSS), open fds, CPU...
        ProcessCollector(registry=r)
        self.requests = Counter(
            "agentgw_requests",
            "Requests by route, status, pool and engine",
            ["route", "status", "pool", "engine"],
            registry=r,
        )
        self.inflight = Gauge(
            "agentgw_inflight_requests", "Requests in flight per engine", ["engine"], registry=r
        )
        self.ttft = Histogram(
            "agentgw_ttft_seconds",
            "Gateway-side time to first byte of the response body",
            ["route"],
            buckets=_LAT_BUCKETS,
            registry=r,
        )
        self.e2e = Histogram(
            "agentgw_e2e_seconds",
            "Gateway-side end-to-end latency",
            ["route"],
            buckets=_LAT_BUCKETS,
            registry=r,
        )
        self.upstream_errors = Counter(
            "agentgw_upstream_errors", "Upstream failures by engine and kind", ["engine", "kind"], registry=r
        )
        self.decisions = Counter(
            "agentgw_route_decisions",
            "Routing decisions by profile, pool and reason",
            ["profile", "pool", "reason"],
            registry=r,
        )
        self.predicted_misses = Counter(
            "agentgw_route_predicted_misses",
            "Routing decisions predicted to miss an SLO bound (slo.ttft_ms or slo.tok_s), by reason "
            "and bound (ttft, tok_s)",
            ["reason", "bound"],
            registry=r,
        )
        self.response_owner_searches = Counter(
            "agentgw_response_owner_searches",
            "Stored responses whose owner record was missing, looked for on the engines, by outcome "
            "(found, not_found, remembered_missing: found nowhere a moment ago)",
            ["outcome"],
            registry=r,
        )
        self.client_disconnects = Counter(
            "agentgw_client_disconnects",
            "Streams aborted because the client went away",
            ["engine"],
            registry=r,
        )
        self.engine_healthy = Gauge(
            "agentgw_engine_healthy", "1 if the engine is admitted", ["engine"], registry=r
        )

        self.migrations = Counter(
            "agentgw_migrations",
            "Inter-turn KV actions by kind and outcome (started, completed, cancelled, failed)",
            ["kind", "outcome"],
            registry=r,
        )
        self.moves = Counter(
            "agentgw_moves",
            "Planner moves by reason (knee_ahead, first_turn_to_warm, rebalance, engine_down) and "
            "outcome: started; completed (the session re-homed); stale (copied, but a newer placement "
            "or a turn in flight kept the home); failed; cancelled_<why> (new_plan, next_turn_arrived, "
            "session_end, shutdown)",
            ["reason", "outcome"],
            registry=r,
        )
        self.migration_bytes = Counter(
            "agentgw_migration_bytes", "Estimated KV bytes moved by prefetches", registry=r
        )
        self.migration_ready = Histogram(
            "agentgw_migration_ready_seconds",
            "Time from the end of a turn until the KV is ready on the target",
            buckets=_LAT_BUCKETS,
            registry=r,
        )
        self.migration_slack = Histogram(
            "agentgw_migration_gap_slack_seconds",
            "Actual gap minus time-to-ready (negative: the turn came first)",
            buckets=(-30, -10, -5, -1, -0.1, 0, 0.1, 1, 5, 10, 30, 120),
            registry=r,
        )
        self.moved_next_turn = Counter(
            "agentgw_moved_next_turn",
            "Cache outcome of the first turn after a move (hit: >= 90% cached)",
            ["outcome"],
            registry=r,
        )
        self.admission_rejections = Counter(
            "agentgw_admission_rejections",
            "Requests refused by admission control, by limit (429 tenant_*, 503 *_busy)",
            ["reason"],
            registry=r,
        )
        self.admission_retries = Counter(
            "agentgw_admission_retry_bookings",
            "Retries booked by capacity refusals (booked), booked retries back in time and queued "
            "first (kept), booked retries refused again (missed), bookings never used (lapsed)",
            ["outcome"],
            registry=r,
        )
        self.admission_waiting = Gauge(
            "agentgw_admission_waiting", "Requests waiting for a global admission slot", registry=r
        )
        self.admission_inflight = Gauge(
            "agentgw_admission_inflight", "Requests holding a global admission slot", registry=r
        )
        self.session_store_degraded = Gauge(
            "agentgw_session_store_degraded",
            "1 while the shared session store (Redis) is unreachable and the local view is used",
            registry=r,
        )
        self.session_store_fallbacks = Counter(
            "agentgw_session_store_fallbacks",
            "Session-store operations served from the local view because Redis failed",
            ["op"],
            registry=r,
        )
        self.session_store_resyncs = Counter(
            "agentgw_session_store_resyncs",
            "Times the local view was written back to Redis after an outage or after Redis lost its data",
            registry=r,
        )
        self.session_evictions = Counter(
            "agentgw_session_evictions",
            "Sessions forgotten before their TTL: tenant_quota (the tenant's own least recently "
            "active, past auth.tenants[].max_sessions) or capacity (sessions.capacity)",
            ["reason"],
            registry=r,
        )
        self.engine_panic = Gauge(
            "agentgw_pool_panic",
            "1 while every engine of the pool fails probes and routing ignores health",
            ["pool"],
            registry=r,
        )

        self.sessions_rehomed = Counter(
            "agentgw_sessions_rehomed",
            "Sessions given a new home because theirs was ejected, by outcome "
            "(prefetch: its prefix is being loaded there; moved; no_target)",
            ["reason", "outcome"],
            registry=r,
        )
        self.session_restarts = Counter(
            "agentgw_session_restarts",
            "Sessions placed as new because the turn shared no prefix with the session's last turn "
            "(a session id reused for an unrelated conversation)",
            registry=r,
        )
        self.analysis_skipped = Counter(
            "agentgw_analysis_skipped",
            "Requests routed on the approximate index because exact prompt analysis was skipped",
            ["reason"],
            registry=r,
        )
        self.index_coverage = Gauge(
            "agentgw_prefix_index_coverage_seconds",
            "Seconds this replica's prefix index has held every KV event of the engine (since it "
            "subscribed, or since lost events cleared the engine's entries); blocks stored before "
            "are unknown to it",
            ["engine"],
            registry=r,
        )
        self.kv_event_gaps = Gauge(
            "agentgw_kv_event_gaps",
            "Gaps in the engine's KV-event sequence seen by this replica (each cleared the engine's "
            "prefix entries)",
            ["engine"],
            registry=r,
        )
        self.membership_changes = Counter(
            "agentgw_engine_membership_changes",
            "Engines added, removed or updated while running (SIGHUP, admin API, discovery file)",
            ["change"],
            registry=r,
        )
        self.tenant_requests = Counter(
            "agentgw_tenant_requests",
            "Requests answered by an engine, by tenant and status class (2xx, 4xx, 5xx)",
            ["tenant", "status"],
            registry=r,
        )
        self.tenant_tokens = Counter(
            "agentgw_tenant_tokens",
            "Tokens by tenant and kind: input (prompt), cached (of the input, served from the "
            "prefix cache), output; from the engines' usage reports (gateway/service/usage.py)",
            ["tenant", "kind"],
            registry=r,
        )
        self.tenant_unreported = Counter(
            "agentgw_tenant_usage_unreported",
            "Answered requests whose answer carried no usage (a stream without include_usage): "
            "input and cached counted from the gateway's own estimate, output not counted",
            ["tenant"],
            registry=r,
        )

        self._children: dict[tuple[object, ...], object] = {}

    def _child(self, metric: object, *labels: str) -> object:
        """``metric.labels(*labels)``, cached: the per-request path pays one dict lookup."""
        key = (id(metric), *labels)
        child = self._children.get(key)
        if child is None:
            if len(self._children) > 100_000:  # bounded: label values come from config and codes
                self._children.clear()
            child = self._children[key] = metric.labels(*labels)  # type: ignore[attr-defined]
        return child

    def count_request(self, route: str, status: str, pool: str, engine: str) -> None:
        self._child(self.requests, route, status, pool, engine).inc()  # type: ignore[attr-defined]

    def count_decision(self, profile: str, pool: str, reason: str, misses: tuple[str, ...] = ()) -> None:
        self._child(self.decisions, profile, pool, reason).inc()  # type: ignore[attr-defined]
        for bound in misses:
            self._child(self.predicted_misses, reason, bound).inc()  # type: ignore[attr-defined]

    def count_analysis_skipped(self, reason: str) -> None:
        self._child(self.analysis_skipped, reason).inc()  # type: ignore[attr-defined]

    def observe_ttft(self, route: str, seconds: float) -> None:
        self._child(self.ttft, route).observe(seconds)  # type: ignore[attr-defined]

    def observe_e2e(self, route: str, seconds: float) -> None:
        self._child(self.e2e, route).observe(seconds)  # type: ignore[attr-defined]

    def render(self) -> bytes:
        return generate_latest(self.registry)
