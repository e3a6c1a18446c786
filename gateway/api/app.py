"""create_app(config): the ASGI application. The lifespan owns every stateful object (the pooled
upstream client, the engine registry and its tasks, the router, the metrics) on ``app.state``;
nothing lives in module globals.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
import threading
from collections.abc import AsyncIterator, Callable, Mapping
from typing import Any

import httpx
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import Response
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.routing import Match

from gateway.api import admin_routes, agent_routes, anthropic_routes, responses_routes
from gateway.api.anthropic_routes import MESSAGES_WIRE
from gateway.api.body_budget import BodyBudget
from gateway.api.drain import Drain
from gateway.api.errors import ApiError, error_body, to_api_error
from gateway.api.openai_routes import OPENAI_WIRES
from gateway.api.relay import GenerationEndpoint, ServiceHolder, Wire, openai_error, send_error
from gateway.api.responses_routes import RESPONSES_WIRE
from gateway.config import ConfigError, GatewayConfig
from gateway.core.router import Router
from gateway.errors import DomainError
from gateway.service.cluster import Cluster
from gateway.service.dashboard import DashboardHistory
from gateway.service.gateway import GatewayService
from gateway.service.membership import read_pools_file
from gateway.service.metrics import GatewayMetrics
from gateway.service.proxy import make_upstream
from gateway.service.request_ids import REQUEST_ID, take_request_id, with_request_id
from gateway.service.session_store import MemorySessionStore, RedisSessionStore, SessionStore

WIRES: tuple[Wire, ...] = (*OPENAI_WIRES, MESSAGES_WIRE, RESPONSES_WIRE)
HOT_ROUTES = tuple(w.route for w in WIRES)


DRAIN_OPEN = frozenset({"/health", "/ready", "/metrics"})
"""Routes still served while draining (liveness, readiness saying so, the last scrape)."""


class GatewayApp:
    """Dispatches the hot POST routes (one per generation API) straight to their raw ASGI
    endpoints and everything else (admin, sessions, docs, lifespan) to FastAPI. While the drain
    runs (gateway/api/drain.py) every other route gets its 503."""

    def __init__(self, api: FastAPI) -> None:
        self.api = api
        self.state = api.state
        holder: ServiceHolder = api.state.holder
        self.drain: Drain = api.state.drain
        bodies: BodyBudget = api.state.bodies
        self._hot = {w.route: GenerationEndpoint(w, holder, self.drain, bodies) for w in WIRES}
        self._render = {w.route: w.render_error for w in WIRES}

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.api(scope, receive, send)
            return
        # the request id: the client's x-request-id or a new one, in the headers the engine gets,
        # on the response and in every log line of the request (gateway/service/request_ids.py)
        rid, own = take_request_id(scope["headers"])
        if not own:
            scope = {**scope, "headers": with_request_id(scope["headers"], rid)}
        token = REQUEST_ID.set(rid.decode())

        async def send_with_id(message: dict[str, Any]) -> None:
            if message["type"] == "http.response.start":
                message = {**message, "headers": with_request_id(list(message.get("headers", ())), rid)}
            await send(message)

        try:
            await self._http(scope, receive, send_with_id)
        finally:
            REQUEST_ID.reset(token)

    async def _http(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        path = scope["path"]
        if self.drain.draining and path not in DRAIN_OPEN:
            render = self._render.get(path, openai_error)
            await send_error(send, self.drain.error(), [(b"connection", b"close")], render)
            return
        endpoint = self._hot.get(path)
        if endpoint is not None and scope["method"] == "POST":
            await endpoint(scope, receive, send)
            return
        await self.api(scope, receive, send)


def allowed_methods(request: Request) -> str:
    """The methods some route serves at this request's path (HEAD, implied by GET, left out)."""
    methods: set[str] = set()
    for route in request.app.router.routes:
        match, _ = route.matches({**request.scope, "method": "GET"})
        route_methods = getattr(route, "methods", None)
        if match is not Match.NONE and route_methods:
            methods |= set(route_methods)
    return ", ".join(sorted(methods - {"HEAD"}))


log = logging.getLogger("agentgw.app")


def create_app(
    config: GatewayConfig,
    *,
    transport: httpx.AsyncBaseTransport | None = None,
    reload: Callable[[], GatewayConfig] | None = None,
    engine_notes: Mapping[str, str] | None = None,
) -> GatewayApp:
    """``reload``: re-reads the configuration (``agentgw serve``'s ``--config`` file) for SIGHUP
    and ``POST /admin/reload``, which apply its ``pools`` (gateway/service/membership.py).
    ``engine_notes``: per engine name, a note ``/ready`` adds while it waits for that engine
    (``agentgw serve``'s local engines: where each one's log is)."""
    static_config = config

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        config = static_config
        if config.discovery.file is not None:  # the engines come from the discovery file
            config = config.model_copy(update={"pools": read_pools_file(config.discovery.file)})
        upstream = make_upstream(config, transport)
        cluster = Cluster(config, upstream.http)
        metrics = GatewayMetrics()
        router = Router(config.router_params())
        s = config.sessions
        quotas = config.session_quotas()  # per tenant: auth.tenants[].max_sessions
        sessions: SessionStore = (
            RedisSessionStore(
                s.redis_url,
                s.capacity,
                s.ttl_s,
                timeout_s=s.redis_timeout_s,
                retry_s=s.redis_retry_s,
                max_conflicts=s.redis_max_conflicts,
                local_capacity=s.local_capacity,
                metrics=metrics,
                quotas=quotas,
            )
            if s.backend == "redis"
            else MemorySessionStore(s.capacity, s.ttl_s, quotas, metrics)
        )
        service = GatewayService(config, upstream, cluster, router, metrics, sessions)
        app.state.service = service
        app.state.tenants = service.tenants
        app.state.holder.service = service
        await cluster.probe_once()
        cluster.start()
        service.start()
        service.membership.reload_config = reload
        app.state.dashboard = DashboardHistory(service)
        app.state.dashboard.start()
        hup = reload is not None and threading.current_thread() is threading.main_thread()
        if hup:
            asyncio.get_running_loop().add_signal_handler(
                signal.SIGHUP, lambda: asyncio.ensure_future(_on_sighup(service))
            )
        try:
            yield
        finally:
            if hup:
                asyncio.get_running_loop().remove_signal_handler(signal.SIGHUP)
            await app.state.dashboard.stop()
            app.state.holder.service = None
            await service.stop()
            await cluster.stop()
            await upstream.aclose()

    # no /docs, /redoc or /openapi.json: they were served without a key (and the pages load
    # their script from a CDN); the contract is openapi/agentgw.yaml
    api = FastAPI(
        title="agentgw", version="0.1.0", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None
    )
    api.state.holder = ServiceHolder()
    api.state.engine_notes = dict(engine_notes or {})
    api.state.drain = Drain(config.drain.deadline_s, config.limits.retry_after_s)
    lim = config.limits
    api.state.bodies = BodyBudget(
        lim.max_buffered_body_bytes, lim.retry_after_s, lim.max_buffered_body_bytes_per_tenant
    )
    api.include_router(admin_routes.router)
    api.include_router(agent_routes.router)
    api.include_router(anthropic_routes.router)
    api.include_router(responses_routes.router)

    @api.exception_handler(ApiError)
    async def _api_error(request: Request, exc: ApiError) -> Response:
        return Response(
            exc.body(),
            status_code=exc.status,
            headers=dict((k.decode(), v.decode()) for k, v in exc.headers()),
        )

    @api.exception_handler(DomainError)
    async def _domain_error(request: Request, exc: DomainError) -> Response:
        return await _api_error(request, to_api_error(exc))

    @api.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException) -> Response:
        headers = dict(exc.headers or {})
        if exc.status_code == 405:  # Allow: every method the path serves (RFC 9110), not one route's
            headers["Allow"] = allowed_methods(request)
        return Response(
            error_body(exc.status_code, str(exc.detail)),
            status_code=exc.status_code,
            media_type="application/json",
            headers=headers,
        )

    @api.exception_handler(RequestValidationError)
    async def _validation_error(request: Request, exc: RequestValidationError) -> Response:
        first = exc.errors()[0] if exc.errors() else {"loc": (), "msg": "invalid request"}
        param = ".".join(str(p) for p in first["loc"] if p != "body") or None
        return Response(
            error_body(400, f"{param or 'request'}: {first['msg']}", param, "invalid_request"),
            status_code=400,
            media_type="application/json",
        )

    for path in HOT_ROUTES:
        # Documented in the schema; the dispatcher above serves POST before FastAPI sees it, and
        # this handler answers the other methods with an OpenAI-shaped 405.
        @api.api_route(
            path, methods=["GET", "PUT", "DELETE", "PATCH", "OPTIONS", "TRACE"], include_in_schema=False
        )
        async def _wrong_method(request: Request) -> Response:
            return Response(
                error_body(405, f"use POST for {request.url.path}"),
                status_code=405,
                media_type="application/json",
                headers={"Allow": "POST"},
            )

    return GatewayApp(api)


async def _on_sighup(service: GatewayService) -> None:
    try:
        await service.membership.reload("SIGHUP")
    except ConfigError as exc:  # a bad file keeps the engines as they are
        log.warning("SIGHUP: %s; engines unchanged", exc)
