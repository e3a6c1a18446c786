"""Liveness, readiness, metrics, the model list and the operator dashboard (FastAPI: not on the
hot path).

The dashboard: ``GET /dashboard`` and ``/dashboard/static/*`` are the static page from the
package (no build step, no CDN, no data in them, so a browser can load them without a key); the
data, ``GET /dashboard/state``, needs an admin key (:func:`require_admin`), which the page sends as
``Authorization: Bearer`` once it is entered. Operator routes, documented in docs/operations.md,
not part of the API contract (openapi/agentgw.yaml).
"""

from __future__ import annotations

import functools
import time
from importlib import resources

from fastapi import APIRouter, Depends, Query, Request
from fastapi.responses import JSONResponse, Response

from gateway.api.auth import read_json_object, require_admin, tenant_of
from gateway.api.errors import ApiError
from gateway.config import ConfigError
from gateway.service.dashboard import MAX_SESSIONS, DashboardHistory, dashboard_state
from gateway.service.gateway import GatewayService
from gateway.service.membership import parse_pools

router = APIRouter()


def _svc(request: Request) -> GatewayService:
    svc: GatewayService = request.app.state.service
    return svc


@router.get("/health", summary="Liveness: the gateway process answers")
async def health() -> dict[str, str]:
    return {"status": "ok"}


@router.get("/ready", summary="Readiness: every configured pool has a healthy engine")
async def ready(request: Request) -> JSONResponse:
    # the pools, the shared store, the engines routing skips and why, how stale the prefix index
    # may be (KV events are not replayed to a replica that (re)starts)
    state = await _svc(request).readiness(time.time())
    pools = state["pools"]
    draining = request.app.state.drain.draining  # SIGTERM: finishing what is in flight
    ok = bool(pools) and all(pools.values()) and not draining
    # with where the engines' logs are when the gateway started them itself
    notes: dict[str, str] = request.app.state.engine_notes
    waiting = {
        name: f"{why} ({notes[name]})" if name in notes else why for name, why in state["waiting_for"].items()
    }
    body = {
        "ready": ok,
        "pools": pools,
        "degraded": state["degraded"],
        "draining": draining,
        "waiting_for": waiting,
        "prefix_index": state["prefix_index"],
    }
    return JSONResponse(body, status_code=200 if ok else 503)


@router.get("/metrics", summary="Prometheus metrics (admin key)", dependencies=[Depends(require_admin)])
async def metrics(request: Request) -> Response:
    text = await _svc(request).metrics_text(time.time())
    return Response(text, media_type="text/plain; version=0.0.4; charset=utf-8")


@router.get("/v1/models", summary="The models served by healthy engines, in OpenAI's shape")
async def models(request: Request) -> dict[str, object]:
    now = int(time.time())
    tenant = tenant_of(request)
    data = [
        {"id": m, "object": "model", "created": now, "owned_by": "agentgw"}
        for m in _svc(request).cluster.models()
        if tenant.allows_model(m)
    ]
    return {"object": "list", "data": data}


# -- engines joining and leaving (gateway/service/membership.py) -------------------------------
def _pools_json(svc: GatewayService) -> dict[str, object]:
    c = svc.cluster
    return {
        "pools": [
            {
                "name": pool,
                "role": c.engines[names[0]].role.value if names else None,
                "engines": [
                    {
                        **c.engines[n].config.model_dump(),
                        "healthy": c.engines[n].healthy,
                        "inflight": c.engines[n].inflight,
                    }
                    for n in names
                ],
            }
            for pool, names in c.pools.items()
        ],
        "leaving": [n for n, s in c.engines.items() if s.removed],
    }


# operator routes (docs/operations.md), not the client contract (openapi/agentgw.yaml), like the
# dashboard's: a fuzzer of the contract must not replace the engine list
@router.get(
    "/admin/pools",
    summary="The engines now (admin key)",
    dependencies=[Depends(require_admin)],
    include_in_schema=False,
)
async def get_pools(request: Request) -> JSONResponse:
    return JSONResponse(_pools_json(_svc(request)))


@router.put(
    "/admin/pools",
    summary="Replace the engine list while running (admin key)",
    dependencies=[Depends(require_admin)],
    include_in_schema=False,
)
async def put_pools(request: Request) -> JSONResponse:
    svc = _svc(request)
    body = await read_json_object(request, svc.config.limits.max_admin_body_bytes)
    if not isinstance(body.get("pools"), list):
        raise ApiError(400, "body must be an object with a list 'pools'", "pools", "invalid_request")
    try:
        pools = parse_pools(body["pools"])
    except ConfigError as exc:
        raise ApiError(400, str(exc), _key_of(str(exc)), "invalid_request") from None
    change = await svc.membership.apply(pools, "admin API")
    return JSONResponse({**change, **_pools_json(svc)})


@router.post(
    "/admin/reload",
    summary="Re-read the config (and discovery) file's pools, as SIGHUP does (admin key)",
    dependencies=[Depends(require_admin)],
    include_in_schema=False,
)
async def reload_pools(request: Request) -> JSONResponse:
    svc = _svc(request)
    try:
        change = await svc.membership.reload("admin reload")
    except ConfigError as exc:
        raise ApiError(400, str(exc), _key_of(str(exc)), "invalid_config") from None
    return JSONResponse({**change, **_pools_json(svc)})


def _key_of(message: str) -> str | None:
    """The key a ConfigError message names (``invalid config key 'pools.0.name': ...``)."""
    head = "invalid config key '"
    if message.startswith(head):
        return message[len(head) :].split("'", 1)[0]
    return None


# -- the operator dashboard ----------------------------------------------------------------------
_ASSETS = {
    "dashboard.html": "text/html; charset=utf-8",
    "dashboard.js": "text/javascript; charset=utf-8",
    "dashboard.css": "text/css; charset=utf-8",
}


SECURITY_HEADERS = {
    # everything the page loads is its own (no inline script or style, nothing from elsewhere)
    "content-security-policy": (
        "default-src 'self'; script-src 'self'; style-src 'self'; img-src 'self' data:; "
        "connect-src 'self'; frame-ancestors 'none'; base-uri 'none'; form-action 'none'"
    ),
    "x-frame-options": "DENY",
    "x-content-type-options": "nosniff",
    "referrer-policy": "no-referrer",
}
"""Sent with every dashboard response (the page, its assets, its data)."""


@functools.cache
def _asset(name: str) -> bytes:
    """A packaged dashboard file (gateway/api/static/), read once."""
    return (resources.files("gateway.api") / "static" / name).read_bytes()


@router.get(
    "/dashboard",
    summary="The operator dashboard (HTML)",
    include_in_schema=False,
)
async def dashboard_page() -> Response:
    return Response(
        _asset("dashboard.html"),
        media_type=_ASSETS["dashboard.html"],
        headers={**SECURITY_HEADERS, "cache-control": "no-cache"},
    )


@router.get(
    "/dashboard/static/{name}",
    summary="The dashboard's script and style",
    include_in_schema=False,
)
async def dashboard_asset(name: str) -> Response:
    media = _ASSETS.get(name)
    if media is None or name == "dashboard.html":
        raise ApiError(404, f"no dashboard asset '{name}'", "name", "not_found")
    return Response(_asset(name), media_type=media, headers={**SECURITY_HEADERS, "cache-control": "no-cache"})


@router.get(
    "/dashboard/state",
    summary="The dashboard's data: pools, engines, sessions, migrations, traffic",
    dependencies=[Depends(require_admin)],
    include_in_schema=False,
)
async def dashboard_data(
    request: Request, sessions: int = Query(MAX_SESSIONS, ge=0, le=MAX_SESSIONS)
) -> JSONResponse:
    svc = _svc(request)
    history: DashboardHistory | None = getattr(request.app.state, "dashboard", None)
    state = await dashboard_state(svc, history, svc.clock(), session_limit=sessions)
    return JSONResponse(state, headers={**SECURITY_HEADERS, "cache-control": "no-store"})
