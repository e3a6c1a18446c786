"""Out-of-band session API and the routing dry run.

- ``POST /v1/agent/sessions/{id}/hints``: hints between turns ("tool started, expect 40 s").
- ``GET /v1/agent/sessions/{id}``: home engine, pool, turns, estimated cached tokens, last
  decision with its reasons.
- ``DELETE /v1/agent/sessions/{id}``: the session is over; its state is released.
- ``POST /debug/route``: what the router would decide for a request (per-scorer breakdown), with
  no side effect. ``?endpoint=completions`` for a completions body (default chat),
  ``?tenant=NAME`` to explain that tenant's request (its ids, its cache salt: its own matches
  only). Admin only.

A tenant's key addresses only its own sessions (ids are namespaced per tenant, see
gateway/service/tenants.py); an admin key addresses stored ids directly. Bodies are bounded:
``limits.max_session_body_bytes`` for the session API, ``limits.max_body_bytes`` for the dry run.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from functools import partial
from typing import Any, Literal

from fastapi import APIRouter, Depends, Query, Request
from fastapi.responses import JSONResponse

from gateway.api import anthropic_routes, responses_routes
from gateway.api.auth import read_body, read_json_object, registry, require_admin, tenant_of
from gateway.api.errors import SERVICE_ERRORS, ApiError, to_api_error
from gateway.core.hints import MAX_ID_LEN, HintError, parse_hints, unknown_hints
from gateway.core.turn import decision_dict
from gateway.service.gateway import GatewayService
from gateway.service.tenants import ANONYMOUS, Tenant
from gateway.wire.openai import ParsedRequest, parse_body

router = APIRouter()


def _svc(request: Request) -> GatewayService:
    svc: GatewayService = request.app.state.service
    return svc


def _stored_id(request: Request, session_id: str) -> tuple[Tenant, str]:
    """The caller's tenant (401 first) and the id its ``session_id`` is stored under (400 for a
    bad id)."""
    tenant = tenant_of(request)
    if not session_id or len(session_id) > MAX_ID_LEN or not session_id.isprintable():
        raise ApiError(
            400, f"session_id must be 1-{MAX_ID_LEN} printable characters", "session_id", "invalid_session_id"
        )
    return tenant, tenant.namespace(session_id)


async def _json_object(request: Request) -> dict[str, Any]:
    return await read_json_object(request, _svc(request).config.limits.max_session_body_bytes)


def _session_json(svc: GatewayService, rec: Any, tenant: Tenant, session_id: str) -> dict[str, Any]:
    matches = svc.session_matches(rec)
    parent = tenant.local_id(rec.parent) if rec.parent is not None else None
    return {
        "id": session_id,
        "object": "agent.session",
        "home_engine": rec.home,
        "pool": rec.pool,
        "turns": rec.turns,
        "context_tokens": rec.context_tokens,
        "estimated_cached_tokens": rec.cached_tokens_est,
        "cached_blocks_by_engine": {e: m.blocks for e, m in matches.items()},
        "parent_session_id": parent,
        "children": [c for c in map(tenant.local_id, rec.children) if c is not None],
        "expected_gap_s": rec.expected_gap(),
        "inflight": rec.inflight,
        "last_activity": rec.last_activity,
        "last_decision": rec.last_decision,
        "migration": svc.migration(rec.session_id),
    }


@router.post("/v1/agent/sessions/{session_id}/hints", summary="Send hints between turns")
async def post_hints(session_id: str, request: Request) -> JSONResponse:
    svc = _svc(request)
    tenant, sid = _stored_id(request, session_id)
    body = await _json_object(request)
    try:
        for unknown in unknown_hints({}, {"agent_hints": body}):
            raise unknown
        hints = parse_hints({}, {"agent_hints": body})
    except HintError as exc:
        raise ApiError(400, str(exc), exc.field.removeprefix("agent_hints."), "invalid_hint") from None
    if hints.parent_session_id is not None:  # the tenant's own ids only, like a turn's hints
        hints = replace(hints, parent_session_id=tenant.namespace(hints.parent_session_id))
    if hints.session_end:
        rec = await svc.end_session(sid)
        return JSONResponse(
            {"id": session_id, "object": "agent.session", "ended": True, "existed": rec is not None}
        )
    rec = await svc.update_hints(sid, hints)
    return JSONResponse(_session_json(svc, rec, tenant, session_id))


@router.get("/v1/agent/sessions/{session_id}", summary="A session's placement and last decision")
async def get_session(session_id: str, request: Request) -> JSONResponse:
    svc = _svc(request)
    tenant, sid = _stored_id(request, session_id)
    rec = await svc.session(sid)
    if rec is None:
        raise ApiError(
            404,
            f"session '{session_id}' is not known (never seen, ended or expired)",
            "session_id",
            "session_not_found",
        )
    return JSONResponse(_session_json(svc, rec, tenant, session_id))


@router.delete("/v1/agent/sessions/{session_id}", summary="End a session and release its state")
async def delete_session(session_id: str, request: Request) -> JSONResponse:
    _tenant, sid = _stored_id(request, session_id)
    rec = await _svc(request).end_session(sid)
    if rec is None:
        raise ApiError(404, f"session '{session_id}' is not known", "session_id", "session_not_found")
    return JSONResponse({"id": session_id, "object": "agent.session", "deleted": True})


_PARSERS: dict[str, Callable[[bytes], ParsedRequest]] = {
    "chat": partial(parse_body, "chat"),
    "completions": partial(parse_body, "completions"),
    "messages": anthropic_routes.parse,
    "responses": responses_routes.parse,
}


@router.post(
    "/debug/route",
    summary="Dry-run routing with the per-scorer breakdown (admin key)",
    dependencies=[Depends(require_admin)],
)
async def debug_route(
    request: Request,
    endpoint: Literal["chat", "completions", "messages", "responses"] = Query("chat"),
    tenant: str | None = Query(None, description="the tenant whose request to explain"),
) -> JSONResponse:
    svc = _svc(request)
    # the request as that tenant's: its session ids, its prefix-cache salt, hence its matches
    # only (an admin's unsalted dry run matches no tenant's cached prefixes)
    who = registry(request).tenants.get(tenant) if tenant is not None else ANONYMOUS
    if who is None:
        raise ApiError(400, f"no tenant named '{tenant}' is configured", "tenant", "invalid_tenant")
    raw = await read_body(request, svc.config.limits.max_body_bytes)
    parsed = _PARSERS[endpoint](raw)
    try:
        a = await svc.analyze(parsed, request.headers.raw, dry_run=True, tenant=who)
        d = svc.decide(a)
    except SERVICE_ERRORS as exc:
        raise to_api_error(exc) from None
    hints = {k: getattr(a.hints, k) for k in a.hints.sources}
    return JSONResponse(
        {
            "decision": decision_dict(d),
            "prompt_tokens": a.request.prompt_tokens,
            "exact_hashes": a.prompt.exact,
            "index": a.prompt.index.value,
            "blocks": len(a.turn.hashes),
            "matches": {
                e: {"blocks": m.blocks, "gpu_blocks": m.gpu_blocks} for e, m in a.snapshot.matches.items()
            },
            "tenant": tenant,
            "hints": hints,
            "hint_sources": a.hints.sources,
            "warning": a.prompt.warning,
        }
    )
