"""The gateway service: routes a parsed request, opens the upstream stream (with one retry on a
connection failure), and records the outcome. Owns no HTTP edge concerns: the api layer pumps
bytes; this layer decides where they go and keeps the books.
"""

from __future__ import annotations

import itertools
import logging
from collections.abc import Sequence
from dataclasses import dataclass

import httpx

from gateway.config import GatewayConfig
from gateway.core.router import NoEngine, Router
from gateway.core.types import Decision, RouteRequest, Snapshot
from gateway.errors import ApiError
from gateway.protocol import ParsedRequest
from gateway.service.cluster import Cluster
from gateway.service.metrics import GatewayMetrics
from gateway.service.proxy import CONNECT_ERRORS, HOP_HEADERS

log = logging.getLogger("agentgw.gateway")


@dataclass(slots=True)
class Plan:
    """Where a parsed request goes and what is sent there."""

    decision: Decision
    body: bytes
    headers: list[tuple[bytes, bytes]]

    def response_headers(self, up: Upstream) -> list[tuple[bytes, bytes]]:
        d = self.decision
        reason = d.reason if not up.retried else "retry"
        return [
            (b"x-agentgw-engine", up.engine.encode()),
            (b"x-agentgw-pool", up.pool.encode()),
            (b"x-agentgw-reason", reason.encode()),
        ]


@dataclass(slots=True)
class Upstream:
    engine: str
    pool: str
    response: httpx.Response
    retried: bool


class GatewayService:
    def __init__(
        self,
        config: GatewayConfig,
        client: httpx.AsyncClient,
        cluster: Cluster,
        router: Router,
        metrics: GatewayMetrics,
    ) -> None:
        self.config = config
        self.client = client
        self.cluster = cluster
        self.router = router
        self.metrics = metrics
        self._seq = itertools.count()
        self.block_size = 128

    def snapshot(self, req: RouteRequest) -> Snapshot:
        return Snapshot(engines=self.cluster.views())

    def route(self, req: RouteRequest) -> Decision:
        try:
            decision = self.router.route(req, self.snapshot(req))
        except NoEngine as exc:
            if exc.reason == "unknown_model":
                raise ApiError(404, str(exc), "model", "model_not_found") from None
            raise ApiError(
                503, str(exc), None, "no_healthy_engine", retry_after=self.config.limits.retry_after_s
            ) from None
        self.metrics.decisions.labels(decision.profile, decision.pool, decision.reason).inc()
        return decision

    def plan(self, parsed: ParsedRequest, raw: bytes, headers: Sequence[tuple[bytes, bytes]]) -> Plan:
        req = RouteRequest(
            model=parsed.model,
            prompt_tokens=parsed.text_chars // 4,
            block_size=self.block_size,
            seq=next(self._seq),
        )
        decision = self.route(req)
        fwd = [(k, v) for k, v in headers if k not in HOP_HEADERS]
        return Plan(decision, raw, fwd)

    def finish(self, plan: Plan, up: Upstream, status: str) -> None:
        """Outcome of a relayed request (sessions and the planner hook in here)."""

    async def open(
        self, decision: Decision, path: str, body: bytes, headers: Sequence[tuple[bytes, bytes]]
    ) -> Upstream:
        """Send the request; on a connection failure before any byte, retry once on another
        engine of the same pool, then give up with a 502."""
        tries = [decision.engine, *decision.fallbacks[:1]]
        last: Exception | None = None
        for i, name in enumerate(tries):
            state = self.cluster.engines[name]
            if i > 0 and not state.healthy:
                continue
            request = self.client.build_request(
                "POST", state.config.url + path, content=body, headers=headers
            )
            self.cluster.begin(name)
            try:
                response = await self.client.send(request, stream=True)
            except CONNECT_ERRORS as exc:
                self.cluster.end(name)
                self.cluster.record_connect_failure(name)
                self.metrics.upstream_errors.labels(name, "connect").inc()
                log.warning("connect to %s failed: %r", name, exc)
                last = exc
                continue
            except httpx.HTTPError as exc:
                self.cluster.end(name)
                self.metrics.upstream_errors.labels(name, type(exc).__name__).inc()
                raise ApiError(
                    502, f"engine '{name}' failed before responding: {exc!r}", None, "upstream_error"
                ) from None
            return Upstream(name, state.pool, response, retried=i > 0)
        raise ApiError(
            502,
            f"could not connect to any engine of pool '{decision.pool}': {last!r}",
            None,
            "upstream_connect_error",
        )

    def close(self, up: Upstream) -> None:
        self.cluster.end(up.engine)
