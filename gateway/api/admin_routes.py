"""Liveness, readiness, metrics and the model list (FastAPI: not on the hot path)."""

from __future__ import annotations

import time

from fastapi import APIRouter, Depends, Request
from fastapi.responses import JSONResponse, Response

from gateway.api.auth import require_admin, tenant_of
from gateway.service.gateway import GatewayService

router = APIRouter()


def _svc(request: Request) -> GatewayService:
    svc: GatewayService = request.app.state.service
    return svc


@router.get("/health", summary="Liveness: the gateway process answers")
async def health() -> dict[str, str]:
    return {"status": "ok"}


@router.get("/ready", summary="Readiness: every configured pool has a healthy engine")
async def ready(request: Request) -> JSONResponse:
    pools = _svc(request).cluster.ready()
    ok = bool(pools) and all(pools.values())
    degraded = await _svc(request).sessions.probe()  # a shared store down: routing on the local view
    return JSONResponse({"ready": ok, "pools": pools, "degraded": degraded}, status_code=200 if ok else 503)


@router.get("/metrics", summary="Prometheus metrics (admin key)", dependencies=[Depends(require_admin)])
async def metrics(request: Request) -> Response:
    svc = _svc(request)
    for name, s in svc.cluster.engines.items():
        svc.metrics.engine_healthy.labels(name).set(1 if s.healthy else 0)
        svc.metrics.inflight.labels(name).set(s.inflight)
    for pool, panic in svc.cluster.panicking().items():
        svc.metrics.engine_panic.labels(pool).set(1 if panic else 0)
    svc.metrics.session_store_degraded.set(1 if await svc.sessions.probe() else 0)
    return Response(svc.metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")


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
