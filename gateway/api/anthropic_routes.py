"""Anthropic's Messages API: ``POST /v1/messages`` (any query string, e.g. ``?beta=true``) through
the shared relay, and ``POST /v1/messages/count_tokens`` forwarded to an engine without making a
session turn. Errors in Anthropic's shape (``{"type": "error", "error": {...}}``); a stream whose
engine fails ends with Anthropic's ``event: error``."""

from __future__ import annotations

import orjson
from fastapi import APIRouter, Request
from fastapi.responses import Response

from gateway.api.auth import read_body, tenant_of
from gateway.api.errors import (
    SERVICE_ERRORS,
    ApiError,
    anthropic_error_body,
    reshape_upstream_error,
    to_api_error,
)
from gateway.api.relay import Wire, declared_length
from gateway.wire import _check
from gateway.wire.anthropic import parse_messages
from gateway.wire.openai import ParsedRequest

__all__ = ["MESSAGES_WIRE", "router"]

router = APIRouter()


def parse(raw: bytes, count_tokens: bool = False) -> ParsedRequest:
    body = _check.load_object(raw)
    w = parse_messages(body, count_tokens=count_tokens)
    assert w.model is not None  # Messages requires a model
    return ParsedRequest("chat", body, w.model, w.stream, w.text_chars, w.chat, w.exact)


def render_error(err: ApiError) -> bytes:
    return err.anthropic_body()


def stream_error(message: str) -> bytes:
    return b"event: error\ndata: " + anthropic_error_body(502, message) + b"\n\n"


def reshape_error(status: int, body: bytes) -> bytes:
    """An engine's error (any shape) in Anthropic's: the message of its OpenAI-shaped form."""
    doc = orjson.loads(reshape_upstream_error(status, body))
    return anthropic_error_body(status, str(doc["error"]["message"]))


MESSAGES_WIRE = Wire(
    "/v1/messages",
    "/v1/messages",
    parse,
    render_error,
    stream_error,
    reshape_error,
    stream_end=(b"event: message_stop",),
)


@router.post("/v1/messages/count_tokens", summary="Anthropic token counting (no session turn)")
async def count_tokens(request: Request) -> Response:
    """Counted against the tenant's concurrency and request rate before the body is read, then
    admitted through the gateway's and the engine's slots, as a turn is."""
    svc = request.app.state.service
    entered = None
    try:
        tenant = tenant_of(request)
        entered = svc.enter(tenant, declared_length(request.headers.raw))
        raw = await read_body(request, svc.config.limits.max_body_bytes)
        parsed = parse(raw, count_tokens=True)
        path = "/v1/messages/count_tokens"
        status, body = await svc.forward_once(parsed, path, raw, request.headers.raw, entered)
    except ApiError as err:
        return _error(err)
    except SERVICE_ERRORS as exc:
        return _error(to_api_error(exc))
    finally:
        if entered is not None:
            entered.leave()
    return Response(body, status_code=status, media_type="application/json")


def _error(err: ApiError) -> Response:
    headers = {k.decode(): v.decode() for k, v in err.headers()}
    return Response(err.anthropic_body(), status_code=err.status, headers=headers)
