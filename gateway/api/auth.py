"""Edge helpers shared by the FastAPI routes: the caller's tenant, the admin guard, and reading a
request body within a limit (413 past it, counted as it streams in) and the gateway's body budget
(gateway/api/body_budget.py)."""

from __future__ import annotations

import ipaddress
from typing import Any

from fastapi import Request

from gateway.api.body_budget import BodyBudget
from gateway.api.errors import SERVICE_ERRORS, ApiError, to_api_error
from gateway.service.tenants import Tenant, TenantRegistry
from gateway.wire._check import load_object


def registry(request: Request) -> TenantRegistry:
    """The app's tenant registry (``app.state.tenants``, set by the lifespan; built from the
    service's config on first use when the lifespan did not; open before there is a service)."""
    state = request.app.state
    reg: TenantRegistry | None = getattr(state, "tenants", None)
    if reg is None:
        service = getattr(state, "service", None)
        if service is None:
            return TenantRegistry({}, ())
        config = service.config
        # `agentgw serve` announced the mode at start-up already
        reg = state.tenants = TenantRegistry.from_config(config.auth, config.listen.host, announce=False)
    return reg


def tenant_of(request: Request) -> Tenant:
    """The caller's tenant; 401 for a missing or unknown key."""
    try:
        return registry(request).authenticate(request.headers.raw)
    except SERVICE_ERRORS as exc:
        raise to_api_error(exc) from None


async def require_admin(request: Request) -> None:
    """FastAPI dependency of every admin route (``/metrics``, ``/debug/*``, ``/dashboard``):
    401 without a valid key, 403 with a tenant's (non-admin) key. With no keys configured, only
    loopback clients pass (403 ``forbidden``)."""
    reg = registry(request)
    if reg.open:
        host = request.client.host if request.client else ""
        try:
            loopback = ipaddress.ip_address(host).is_loopback
        except ValueError:
            loopback = False
        if not loopback:
            raise ApiError(
                403,
                "admin routes are served to loopback clients only when no API keys are configured",
                None,
                "forbidden",
            )
        return
    try:
        reg.require_admin(request.headers.raw)
    except SERVICE_ERRORS as exc:
        raise to_api_error(exc) from None


def body_owner(request: Request) -> str:
    """Whom a request's body bytes are charged to in the body budget: its tenant, or its client
    address when no API keys are configured (everyone is the anonymous tenant then)."""
    reg = registry(request)
    if reg.open:
        return "addr:" + (request.client.host if request.client else "")
    return "tenant:" + tenant_of(request).name


async def read_body(request: Request, limit: int) -> bytes:
    """The request body, or a 413 as soon as it is known to exceed ``limit`` bytes. Its bytes
    are claimed from the body budget as they arrive (never on the declared length)."""
    declared = request.headers.get("content-length")
    if declared is not None:
        try:
            size = int(declared)
        except ValueError:
            raise ApiError(400, "content-length is not a number", None, "invalid_request") from None
        if size > limit:
            raise ApiError(413, f"request body exceeds {limit} bytes", None, "body_too_large")
    chunks: list[bytes] = []
    total = 0
    budget: BodyBudget | None = getattr(request.app.state, "bodies", None)
    claim = budget.claim(body_owner(request)) if budget is not None else None
    try:
        async for chunk in request.stream():
            total += len(chunk)
            if total > limit:
                raise ApiError(413, f"request body exceeds {limit} bytes", None, "body_too_large")
            if claim is not None:
                claim.take(len(chunk))
            chunks.append(chunk)
    finally:
        if claim is not None:
            claim.release()
    return b"".join(chunks)


async def read_json_object(request: Request, limit: int) -> dict[str, Any]:
    """The request body as a JSON object, read as :func:`read_body` reads it (``limit``, the body
    budget) and parsed as the generation endpoints parse theirs (orjson: nesting past 1,024
    levels is a 400 ``invalid_json``, never a RecursionError). An empty body is ``{}``. Every
    route other than the generation endpoints that reads a body reads it here."""
    return load_object(await read_body(request, limit) or b"{}")
