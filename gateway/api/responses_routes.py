"""OpenAI's Responses API. ``POST /v1/responses`` goes through the shared relay (a stream whose
engine fails ends with ``response.failed``); a request with ``previous_response_id``, and
``GET /v1/responses/{id}`` and ``POST /v1/responses/{id}/cancel``, reach the engine that stored
the response (vLLM keeps it in that engine's memory), or get OpenAI's 404 for an unknown id.
The routes vLLM 0.32 does not serve (``DELETE /v1/responses/{id}``,
``GET /v1/responses/{id}/input_items``) answer a clear OpenAI-shaped 501."""

from __future__ import annotations

import orjson
from fastapi import APIRouter, Request
from fastapi.responses import Response

from gateway.api.auth import tenant_of
from gateway.api.errors import SERVICE_ERRORS, ApiError, to_api_error
from gateway.api.relay import Wire
from gateway.errors import BadRequest
from gateway.service.responses import RESPONSE_ID
from gateway.wire import _check
from gateway.wire.openai import ParsedRequest
from gateway.wire.responses import parse_responses

__all__ = ["RESPONSES_WIRE", "router"]

router = APIRouter()


def parse(raw: bytes) -> ParsedRequest:
    body = _check.load_object(raw)
    w = parse_responses(body)
    if w.model is None:
        raise BadRequest("'model' is required", "model", "missing_required_parameter")
    return ParsedRequest(
        "chat", body, w.model, w.stream, w.text_chars, w.chat, w.exact, w.previous_response_id, w.store
    )


def stream_error(message: str) -> bytes:
    event = {
        "type": "response.failed",
        "response": {
            "object": "response",
            "status": "failed",
            "error": {"code": "server_error", "message": message},
        },
    }
    return b"event: response.failed\ndata: " + orjson.dumps(event) + b"\n\n"


RESPONSES_WIRE = Wire(
    "/v1/responses",
    "/v1/responses",
    parse,
    stream_error=stream_error,
    stores_responses=True,
    stream_end=(b"event: response.completed", b"event: response.incomplete"),
)


def _error(err: ApiError) -> Response:
    headers = {k.decode(): v.decode() for k, v in err.headers()}
    return Response(err.body(), status_code=err.status, headers=headers)


async def _to_owner(request: Request, response_id: str, method: str, path: str) -> Response:
    try:
        tenant = tenant_of(request)  # who asks, before anything is said about the id
    except ApiError as err:
        return _error(err)
    if not RESPONSE_ID.match(response_id):
        return _error(
            ApiError(400, "'response_id' is not a valid response id", "response_id", "invalid_value")
        )
    try:
        status, body = await request.app.state.service.call_owner(response_id, method, path, tenant)
    except ApiError as err:
        return _error(err)
    except SERVICE_ERRORS as exc:
        return _error(to_api_error(exc))
    return Response(body, status_code=status, media_type="application/json")


@router.get("/v1/responses/{response_id}", summary="A stored response, from the engine that holds it")
async def retrieve(response_id: str, request: Request) -> Response:
    return await _to_owner(request, response_id, "GET", f"/v1/responses/{response_id}")


@router.post("/v1/responses/{response_id}/cancel", summary="Cancel a background response")
async def cancel(response_id: str, request: Request) -> Response:
    return await _to_owner(request, response_id, "POST", f"/v1/responses/{response_id}/cancel")


def _unsupported(request: Request, what: str) -> Response:
    """The 501, to an authenticated caller only (401 first, as on every API route)."""
    try:
        tenant_of(request)
    except ApiError as err:
        return _error(err)
    return _error(
        ApiError(
            501,
            f"{what} is not supported by the engines behind this gateway (vLLM 0.32)",
            None,
            "unsupported_endpoint",
        )
    )


@router.delete("/v1/responses/{response_id}", summary="Not served by vLLM 0.32: a clear 501")
async def delete(response_id: str, request: Request) -> Response:
    return _unsupported(request, "DELETE /v1/responses/{id}")


@router.get("/v1/responses/{response_id}/input_items", summary="Not served by vLLM 0.32: a clear 501")
async def input_items(response_id: str, request: Request) -> Response:
    return _unsupported(request, "GET /v1/responses/{id}/input_items")
