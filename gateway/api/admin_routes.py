"""Liveness, readiness, metrics and the model list (FastAPI: not on the hot path)."""

from __future__ import annotations

import time

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response

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
    return JSONResponse({"ready": ok, "pools": pools}, status_code=200 if ok else 503)


@router.get("/metrics", summary="Prometheus metrics")
async def metrics(request: Request) -> Response:
    svc = _svc(request)
    for name, s in svc.cluster.engines.items():
        svc.metrics.engine_healthy.labels(name).set(1 if s.healthy else 0)
        svc.metrics.inflight.labels(name).set(s.inflight)
    return Response(svc.metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")


@router.get("/v1/models", summary="The models served by healthy engines, in OpenAI's shape")
async def models(request: Request) -> dict[str, object]:
    now = int(time.time())
    data = [
        {"id": m, "object": "model", "created": now, "owned_by": "agentgw"}
        for m in _svc(request).cluster.models()
    ]
    return {"object": "list", "data": data}
