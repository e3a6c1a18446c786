"""The hot path's edge, for every generation API: a raw ASGI endpoint that authenticates the
caller and hands the turn to the service's pipeline (:mod:`gateway.service.turns`, which orders
every stage) through a connection that speaks the API's shape: it reads the body (bounded),
parses it once through the wire adapter, renders errors and stream error events, and sends
each chunk the pipeline relays.

It bypasses Starlette's Request/StreamingResponse (a measurable cost per chunk, ANCHORS.md). A
client that disconnects, while the engine is being reached or mid-stream, cancels the turn,
which closes the upstream connection, so vLLM aborts the request and frees its KV. An engine that
fails mid-stream ends a streamed answer with an explicit error event in the API's own streaming
form (:attr:`Wire.stream_error`), never a silent truncation.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from gateway.api.body_budget import BodyBudget, Claim
from gateway.api.drain import Drain, Flight
from gateway.api.errors import SERVICE_ERRORS, ApiError, error_body, reshape_upstream_error, to_api_error
from gateway.api.server import ABORT_EXTENSION
from gateway.errors import TooLarge
from gateway.service.gateway import GatewayService
from gateway.service.tenants import Tenant
from gateway.service.turns import Route
from gateway.wire.openai import ParsedRequest

Scope = dict[str, Any]


class ServiceHolder:
    """Where the lifespan puts the app's service for the hot endpoints (a plain attribute:
    Starlette's ``State.__getattr__`` was a measurable per-request cost)."""

    service: GatewayService | None = None


def openai_error(err: ApiError) -> bytes:
    return err.body()


def openai_stream_error(message: str) -> bytes:
    """Chat and Completions: an error chunk, then ``[DONE]``."""
    return b"data: " + error_body(502, message, None, "upstream_error") + b"\n\ndata: [DONE]\n\n"


@dataclass(frozen=True, slots=True)
class Wire:
    """One generation API as seen by the relay."""

    route: str
    """The path this endpoint serves (the metrics label)."""
    upstream_path: str
    """The engine's path for it."""
    parse: Callable[[bytes], ParsedRequest]
    render_error: Callable[[ApiError], bytes] = openai_error
    stream_error: Callable[[str], bytes] = openai_stream_error
    """The event that ends a stream whose engine failed mid-response."""
    reshape_error: Callable[[int, bytes], bytes] = reshape_upstream_error
    """An engine's error body in this API's error shape."""
    stores_responses: bool = False
    """The engine may store the answer (Responses API): the gateway records its id's engine."""
    stream_end: tuple[bytes, ...] = (b"data: [DONE]",)
    """What the stream's last event holds (Chat/Completions ``[DONE]``): once one has been relayed
    whole, the answer is delivered, and a client that leaves before the engine closes the
    stream (Codex drops the connection at ``response.completed``) is not a 499."""


def declared_length(headers: list[tuple[bytes, bytes]]) -> int | None:
    """The request's ``content-length`` (None: absent or not a number; the server checks it)."""
    for k, v in headers:
        if k == b"content-length":
            return int(v) if v.isdigit() else None
    return None


async def read_body(
    receive: Any, limit: int, claim: Claim | None = None, declared: int | None = None
) -> bytes:
    """The whole body, within ``limit`` (:class:`~gateway.errors.TooLarge`: a 413) and, with a
    ``claim``, the gateway's body budget (:class:`~gateway.errors.Refused`: a 429 past the owner's
    share, a 503 past the whole; the claim holds the bytes until it is released). A ``declared``
    length past ``limit`` is refused before a byte is read; bytes are claimed as they arrive,
    never on the declared length (a client announcing 32 MiB and sending one byte holds one
    byte)."""
    if declared is not None and declared > limit:
        raise TooLarge(f"request body exceeds {limit} bytes")
    chunks: list[bytes] = []
    size = 0
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            raise ConnectionAbortedError
        chunk = message.get("body", b"")
        size += len(chunk)
        if size > limit:
            raise TooLarge(f"request body exceeds {limit} bytes")
        if claim is not None and chunk:
            claim.take(len(chunk))
        chunks.append(chunk)
        if not message.get("more_body", False):
            return chunks[0] if len(chunks) == 1 else b"".join(chunks)


def body_owner(svc: GatewayService, tenant: Tenant, scope: Scope) -> str:
    """Whom the body's bytes are charged to (gateway/api/body_budget.py): the tenant, or the
    client's address when no API keys are configured."""
    if svc.tenants.open:
        client = scope.get("client")
        return "addr:" + (client[0] if client else "")
    return "tenant:" + tenant.name


async def wait_disconnect(receive: Any) -> None:
    """Return when the client goes away. Any other message is skipped, as Starlette's
    ``listen_for_disconnect`` does, so one unexpected message cannot leave the relay blind to a
    later disconnect."""
    while (await receive())["type"] != "http.disconnect":
        pass


async def send_error(
    send: Any,
    err: ApiError,
    extra: list[tuple[bytes, bytes]] | None = None,
    render: Callable[[ApiError], bytes] = openai_error,
) -> None:
    body = render(err)
    headers = [*err.headers(), (b"content-length", str(len(body)).encode()), *(extra or [])]
    await send({"type": "http.response.start", "status": err.status, "headers": headers})
    await send({"type": "http.response.body", "body": body})


class _AsgiEdge:
    """One turn's client connection, in its API's shape (the pipeline's :class:`Edge`)."""

    __slots__ = (
        "claim",
        "declared",
        "flight",
        "limit",
        "raw",
        "receive",
        "responded",
        "scope",
        "send_",
        "stream",
        "wire",
    )

    def __init__(
        self,
        wire: Wire,
        scope: Scope,
        receive: Any,
        send: Any,
        limit: int,
        flight: Flight | None,
        claim: Claim | None,
    ) -> None:
        self.wire = wire
        self.limit = limit
        self.declared = declared_length(scope["headers"])
        """The body's declared length (None: chunked, or not a number)."""
        self.scope = scope
        self.receive = receive
        self.send_ = send
        self.flight = flight
        self.claim = claim
        self.raw: bytes | None = None
        self.stream = False
        self.responded = False

    async def read(self) -> bytes:
        self.raw = await read_body(self.receive, self.limit, self.claim, self.declared)
        return self.raw

    def parse(self, raw: bytes) -> ParsedRequest:
        parsed = self.wire.parse(raw)
        self.stream = parsed.stream
        return parsed

    async def wait_disconnect(self) -> None:
        await wait_disconnect(self.receive)

    async def refuse(self, exc: BaseException, headers: list[tuple[bytes, bytes]]) -> int:
        err = exc if isinstance(exc, ApiError) else to_api_error(exc)  # type: ignore[arg-type]
        # refused before its body was read (401, 413, the body budget's 503): close the
        # connection rather than read and discard the rest of the body to keep it alive
        extra = [(b"connection", b"close")] if self.raw is None else headers
        self._responded()
        await send_error(self.send_, err, extra, self.wire.render_error)
        return err.status

    def reshape(self, status: int, body: bytes) -> bytes:
        return self.wire.reshape_error(status, body)

    def stream_error(self, message: str) -> bytes:
        return self.wire.stream_error(message)

    async def respond(self, status: int, headers: list[tuple[bytes, bytes]], body: bytes) -> None:
        self._responded()
        await self.send_({"type": "http.response.start", "status": status, "headers": headers})
        await self.send_({"type": "http.response.body", "body": body})

    async def start(self, status: int, headers: list[tuple[bytes, bytes]]) -> None:
        await self.send_({"type": "http.response.start", "status": status, "headers": headers})
        self._responded()

    async def send(self, chunk: bytes) -> None:
        await self.send_({"type": "http.response.body", "body": chunk, "more_body": True})

    async def end(self, tail: bytes = b"") -> None:
        await self.send_({"type": "http.response.body", "body": tail, "more_body": False})

    def abort(self) -> None:
        cut = (self.scope.get("extensions") or {}).get(ABORT_EXTENSION)
        if cut is not None:
            cut()

    def _responded(self) -> None:
        self.responded = True
        if self.flight is not None:
            self.flight.responded = True


def _uncancel(task: asyncio.Task[Any] | None) -> None:
    """The cancellation was the drain's: let the task go on to end its response."""
    if task is not None:
        task.uncancel()


class GenerationEndpoint:
    """The edge of every generation API: authenticates the caller, hands the turn to the
    service's pipeline (:class:`gateway.service.turns.Turns`) with a connection that speaks the
    API's shape, and ends what the drain cuts."""

    def __init__(
        self,
        wire: Wire,
        holder: ServiceHolder,
        drain: Drain | None = None,
        bodies: BodyBudget | None = None,
    ) -> None:
        self.wire = wire
        self.route = wire.route
        self.turn_route = Route(wire.route, wire.upstream_path, wire.stores_responses, wire.stream_end)
        self._holder = holder
        self._drain = drain
        self._bodies = bodies

    async def __call__(self, scope: Scope, receive: Any, send: Any) -> None:
        svc = self._holder.service
        wire = self.wire
        if svc is None:
            err = ApiError(503, "the gateway is starting", None, "starting", retry_after=1)
            await send_error(send, err, render=wire.render_error)
            return
        claim = self._bodies.claim() if self._bodies is not None else None
        try:
            drain = self._drain
            flight = drain.enter() if drain is not None else None
            limit = svc.config.limits.max_body_bytes
            edge = _AsgiEdge(wire, scope, receive, send, limit, flight, claim)
            try:
                await self._handle(svc, scope, edge)
            except asyncio.CancelledError:
                if flight is None or not flight.cut or drain is None:
                    raise
                _uncancel(flight.task)
                with contextlib.suppress(RuntimeError, OSError):
                    if not edge.responded:  # cut before its answer began: the drain's 503
                        await send_error(send, drain.error(), [(b"connection", b"close")], wire.render_error)
                    else:  # cut mid-answer: end it the way an engine failure does
                        tail = wire.stream_error(drain.stream_message()) if edge.stream else b""
                        await edge.end(tail)
            finally:
                if drain is not None and flight is not None:
                    drain.leave(flight)
        finally:
            if claim is not None:  # the body lived as long as the request
                claim.release()

    async def _handle(self, svc: GatewayService, scope: Scope, edge: _AsgiEdge) -> None:
        headers = scope["headers"]
        try:
            tenant = svc.tenants.authenticate(headers)
            if edge.declared is not None and edge.declared > edge.limit:
                raise TooLarge(f"request body exceeds {edge.limit} bytes")
        except SERVICE_ERRORS as exc:
            status = await edge.refuse(exc, [])
            svc.metrics.count_request(self.route, str(status), "", "")
            return
        if edge.claim is not None:
            edge.claim.owner = body_owner(svc, tenant, scope)
        await svc.turns.run(self.turn_route, tenant, headers, edge)
