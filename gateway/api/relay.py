"""The hot path, for every generation API: a raw ASGI endpoint that reads the body, parses it
once through its wire adapter, asks the service where it goes, then relays each upstream chunk
as soon as it arrives.

It bypasses Starlette's Request/StreamingResponse (a measurable cost per chunk, ANCHORS.md). A
client that disconnects, while the engine is being reached or mid-stream, cancels the relay,
which closes the upstream connection, so vLLM aborts the request and frees its KV. An engine that
fails mid-stream ends a streamed answer with an explicit error event in the API's own streaming
form (:attr:`Wire.stream_error`), never a silent truncation.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

import aiohttp

from gateway.api.body_budget import BodyBudget, Claim
from gateway.api.drain import Drain, Flight
from gateway.api.errors import SERVICE_ERRORS, to_api_error
from gateway.api.server import ABORT_EXTENSION
from gateway.errors import ApiError, error_body, reshape_upstream_error
from gateway.protocol import ParsedRequest
from gateway.service.admission import TenantPass
from gateway.service.errors import ResponseNotFound
from gateway.service.gateway import GatewayService, Plan, Relay
from gateway.service.responses import SCAN_BYTES, find_response_id
from gateway.service.tenants import Tenant

log = logging.getLogger("agentgw.api")

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
    """The whole body, within ``limit`` (413) and, with a ``claim``, the gateway's body budget
    (429 past the owner's share, 503 past the whole; the claim holds the bytes until it is
    released). A ``declared`` length past ``limit`` is refused before a byte is read; bytes are
    claimed as they arrive, never on the declared length (a client announcing 32 MiB and
    sending one byte holds one byte)."""
    if declared is not None and declared > limit:
        raise ApiError(413, f"request body exceeds {limit} bytes", None, "request_too_large")
    chunks: list[bytes] = []
    size = 0
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            raise ConnectionAbortedError
        chunk = message.get("body", b"")
        size += len(chunk)
        if size > limit:
            raise ApiError(413, f"request body exceeds {limit} bytes", None, "request_too_large")
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


async def _after(first: bytes, rest: AsyncIterator[bytes]) -> AsyncIterator[bytes]:
    """``first``, then what is left of ``rest``."""
    yield first
    async for chunk in rest:
        yield chunk


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


class _Watch:
    """Cancels the task that runs the relay when the client disconnects."""

    def __init__(self, receive: Any) -> None:
        self.gone = False
        self.done = False
        self._task = asyncio.current_task()
        self._fut = asyncio.ensure_future(wait_disconnect(receive))
        self._fut.add_done_callback(self._on_gone)

    def _on_gone(self, fut: asyncio.Future[Any]) -> None:
        if fut.cancelled() or fut.exception() is not None or self.done or self._task is None:
            return
        self.gone = True
        self._task.cancel()

    def stop(self) -> None:
        self.done = True
        self._fut.cancel()

    def absorb(self) -> None:
        """The cancellation was ours (the client left): let the task go on to clean up."""
        uncancel = getattr(self._task, "uncancel", None)
        if uncancel is not None:
            uncancel()


def _uncancel(task: asyncio.Task[Any] | None) -> None:
    """The cancellation was the drain's: let the task go on to end its response."""
    if task is not None:
        task.uncancel()


class GenerationEndpoint:
    def __init__(
        self,
        wire: Wire,
        holder: ServiceHolder,
        drain: Drain | None = None,
        bodies: BodyBudget | None = None,
    ) -> None:
        self.wire = wire
        self.route = wire.route
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
            if drain is None:
                await self._handle(svc, scope, receive, send, None, claim)
                return
            flight = drain.enter()
            try:
                await self._handle(svc, scope, receive, send, flight, claim)
            except asyncio.CancelledError:
                if not flight.cut:
                    raise
                _uncancel(flight.task)
                if not flight.responded:  # cut before its answer began: the drain's 503
                    with contextlib.suppress(RuntimeError, OSError):
                        await send_error(send, drain.error(), [(b"connection", b"close")], wire.render_error)
            finally:
                drain.leave(flight)
        finally:
            if claim is not None:  # the body lived as long as the request
                claim.release()

    async def _handle(
        self,
        svc: GatewayService,
        scope: Scope,
        receive: Any,
        send: Any,
        flight: Flight | None,
        claim: Claim | None = None,
    ) -> None:
        wire = self.wire
        t0 = time.perf_counter()
        headers = scope["headers"]
        try:
            tenant = svc.tenants.authenticate(headers)
            limit = svc.config.limits.max_body_bytes
            declared = declared_length(headers)
            if declared is not None and declared > limit:
                raise ApiError(413, f"request body exceeds {limit} bytes", None, "request_too_large")
            # the tenant's concurrency and rate limits before a byte of the body is read (its
            # tokens estimated from the declared length, settled once analysed): a refused
            # request costs its headers, not a read, a parse and an analysis
            entered = svc.admission.enter(tenant, (declared or 0) // 4)
        except ApiError as err:
            svc.metrics.count_request(self.route, str(err.status), "", "")
            # the body is unread: close the connection rather than read and discard it
            await send_error(send, err, [(b"connection", b"close")], render=wire.render_error)
            return
        try:
            if claim is not None:
                claim.owner = body_owner(svc, tenant, scope)
            await self._turn(svc, scope, receive, send, flight, claim, tenant, entered, t0)
        finally:
            entered.leave()

    async def _turn(
        self,
        svc: GatewayService,
        scope: Scope,
        receive: Any,
        send: Any,
        flight: Flight | None,
        claim: Claim | None,
        tenant: Tenant,
        entered: TenantPass,
        t0: float,
    ) -> None:
        wire = self.wire
        raw: bytes | None = None
        try:
            raw = await read_body(receive, svc.config.limits.max_body_bytes, claim)
            await svc.admission.turnstile.enter()  # a burst is analysed over several loop iterations
            parsed = wire.parse(raw)
            plan = await svc.plan(parsed, raw, scope["headers"], tenant)
        except ConnectionAbortedError:
            return
        except (ApiError, *SERVICE_ERRORS) as exc:
            err = exc if isinstance(exc, ApiError) else to_api_error(exc)
            svc.metrics.count_request(self.route, str(err.status), "", "")
            # refused before its body was read (the body budget's 429/503): close the
            # connection rather than read and discard the rest of the body to keep it alive
            unread = [(b"connection", b"close")] if raw is None else None
            await send_error(send, err, unread, render=wire.render_error)
            return
        interactive = plan.analysis.hints.interactive
        # the client may leave while the request waits for a slot: it must then never reach
        # an engine (watched from here on, not only once the engine is being reached)
        watch = _Watch(receive)
        async with contextlib.AsyncExitStack() as admitted:
            try:
                # the gateway's limits (the tenant's were checked before the body), then the
                # engine's; interactive turns first
                await admitted.enter_async_context(
                    svc.admission.admit(
                        tenant, interactive, plan.analysis.request.prompt_tokens, entered=entered
                    )
                )
                await admitted.enter_async_context(
                    svc.admission.engine_slot(plan.decision.engine, interactive)
                )
            except ApiError as err:
                watch.stop()
                await svc.abandon(plan)
                svc.metrics.count_request(self.route, str(err.status), plan.decision.pool, "")
                await send_error(send, err, plan.extra_headers, wire.render_error)
                return
            except asyncio.CancelledError:
                if watch.gone:  # the client left while queued: never sent
                    watch.absorb()
                    svc.metrics.count_request(self.route, "499", plan.decision.pool, "")
                    await svc.abandon(plan)
                    return
                watch.stop()
                if flight is not None and flight.cut:
                    await svc.abandon(plan)
                raise
            abort = (scope.get("extensions") or {}).get(ABORT_EXTENSION)
            await self._serve(svc, plan, parsed, t0, send, flight, watch, abort)

    async def _serve(
        self,
        svc: GatewayService,
        plan: Plan,
        parsed: ParsedRequest,
        t0: float,
        send: Any,
        flight: Flight | None,
        watch: _Watch,
        abort: Callable[[], None] | None = None,
    ) -> None:
        wire = self.wire
        try:
            up = await svc.open(
                plan.decision,
                wire.upstream_path,
                plan.body,
                plan.headers,
                parsed.stream,
                continues=parsed.previous_response_id,
            )
        except asyncio.CancelledError:
            if not watch.gone:
                watch.stop()
                if flight is not None and flight.cut:  # the drain's deadline: its 503 follows
                    await svc.abandon(plan)
                raise
            watch.absorb()
            svc.metrics.count_request(self.route, "499", plan.decision.pool, "")
            await svc.abandon(plan)
            return
        except SERVICE_ERRORS as exc:
            watch.stop()
            err = to_api_error(exc)
            await svc.abandon(plan)
            svc.metrics.count_request(self.route, str(err.status), plan.decision.pool, "")
            await send_error(send, err, plan.extra_headers, wire.render_error)
            return
        try:
            if up.status >= 400:
                watch.stop()
                await self._relay_error(svc, plan, up, t0, send, parsed.previous_response_id)
                return
            record = wire.stores_responses and parsed.store and up.status == 200
            await self._relay(svc, plan, up, t0, send, watch, parsed.stream, record, flight, abort)
        finally:
            up.close()

    async def _relay_error(
        self, svc: GatewayService, plan: Plan, up: Relay, t0: float, send: Any, continues: str | None = None
    ) -> None:
        """An engine's error answer, re-shaped into the API's error shape (vLLM's own errors are
        ``{"detail": ...}`` on some paths). The owner's 404 for a ``previous_response_id`` (it
        evicted the response) becomes OpenAI's 400 ``previous_response_not_found``, as when the
        gateway knows no owner."""
        status = "502"
        try:
            raw = await up.read()
            if up.status == 404 and continues is not None:
                err = to_api_error(
                    ResponseNotFound(continues, "previous_response_id", "its engine no longer holds it")
                )
                up_status, body = err.status, self.wire.render_error(err)
            else:
                up_status, body = up.status, self.wire.reshape_error(up.status, raw)
            status = str(up_status)
            headers = [
                (b"content-type", b"application/json"),
                (b"content-length", str(len(body)).encode()),
                *plan.response_headers(up),
            ]
            await send({"type": "http.response.start", "status": up_status, "headers": headers})
            await send({"type": "http.response.body", "body": body})
        except (TimeoutError, aiohttp.ClientError) as exc:
            svc.metrics.upstream_errors.labels(up.engine, type(exc).__name__).inc()
            err = ApiError(502, f"engine '{up.engine}' failed mid-response: {exc!r}", None, "upstream_error")
            await send_error(send, err, render=self.wire.render_error)
        except OSError:
            status = "499"
        finally:
            svc.metrics.observe_e2e(self.route, time.perf_counter() - t0)
            svc.metrics.count_request(self.route, status, up.pool, up.engine)
            await svc.finish(plan, up, status)

    async def _relay(
        self,
        svc: GatewayService,
        plan: Plan,
        up: Relay,
        t0: float,
        send: Any,
        watch: _Watch,
        stream: bool,
        record_id: bool,
        flight: Flight | None = None,
        abort: Callable[[], None] | None = None,
    ) -> None:
        """``abort``: the server's way to cut the client connection mid-response (without it,
        a whole answer cut mid-body is left unfinished for the server to close)."""
        headers = up.headers() + plan.response_headers(up)
        status = str(up.status)
        started = False
        first = True
        head = b""
        delivered = False  # the stream's last event has been relayed whole
        ends = self.wire.stream_end if stream else ()
        chunks = up.chunks()
        try:
            if not stream:
                # a whole answer's status line waits for its first bytes: an engine failing
                # before them is a 502 in the API's shape, not a 200 with an empty body
                async for chunk in chunks:
                    chunks = _after(chunk, chunks)
                    break
            await send({"type": "http.response.start", "status": up.status, "headers": headers})
            started = True
            if flight is not None:
                flight.responded = True
            async for chunk in chunks:
                if first:
                    svc.metrics.observe_ttft(self.route, time.perf_counter() - t0)
                    first = False
                if record_id:
                    head += chunk
                    rid = find_response_id(head)
                    if rid is not None or len(head) >= SCAN_BYTES:
                        record_id = False
                        if rid is not None:
                            await svc.remember_response(rid, up, plan.tenant)
                await send({"type": "http.response.body", "body": chunk, "more_body": True})
                if ends and not delivered and chunk.endswith(b"\n\n") and any(e in chunk for e in ends):
                    delivered = True
            watch.done = True
            await send({"type": "http.response.body", "body": b"", "more_body": False})
        except asyncio.CancelledError:
            if not watch.gone and flight is not None and flight.cut and self._drain is not None:
                # the drain deadline passed: end the stream the way an engine failure does
                _uncancel(flight.task)
                status = "503"
                with contextlib.suppress(Exception):
                    if not started:
                        flight.responded = True
                        if not stream:
                            await send_error(send, self._drain.error(), None, self.wire.render_error)
                            return
                        await send({"type": "http.response.start", "status": 503, "headers": headers})
                    tail = self.wire.stream_error(self._drain.stream_message()) if stream else b""
                    await send({"type": "http.response.body", "body": tail, "more_body": False})
                return
            if not watch.gone:
                raise
            if not delivered:
                status = "499"
                svc.metrics.client_disconnects.labels(up.engine).inc()
            watch.absorb()
        except (TimeoutError, aiohttp.ClientError) as exc:
            status = "502"
            watch.stop()
            svc.metrics.upstream_errors.labels(up.engine, type(exc).__name__).inc()
            # died or froze: ejected; whether it still listens, the next probe says
            svc.cluster.record_connect_failure(up.engine, refused=False)
            log.warning("upstream %s failed mid-response: %r", up.engine, exc)
            message = f"engine '{up.engine}' failed mid-response: {exc!r}"
            with contextlib.suppress(Exception):
                if not started:  # nothing sent yet: the API's error
                    err = ApiError(502, message, None, "upstream_error")
                    await send_error(send, err, plan.response_headers(up), self.wire.render_error)
                elif stream:  # the API's error event ends the stream
                    await send(
                        {
                            "type": "http.response.body",
                            "body": self.wire.stream_error(message),
                            "more_body": False,
                        }
                    )
                elif abort is not None:
                    # part of a whole answer is out: cut the connection before its end, so the
                    # client sees a failure, never a short answer that looks complete
                    abort()
        except OSError:
            # the server's send() raised (ASGI 2.4: the client connection is closed) before the
            # disconnect watcher fired: the same outcome
            if not delivered:
                status = "499"
                svc.metrics.client_disconnects.labels(up.engine).inc()
        finally:
            watch.stop()
            svc.metrics.observe_e2e(self.route, time.perf_counter() - t0)
            svc.metrics.count_request(self.route, status, up.pool, up.engine)
            await svc.finish(plan, up, status)
