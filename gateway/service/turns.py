"""The turn pipeline: one generation request's life, and the only place that orders its stages.

::

    0 tenant        the tenant's concurrency and rate limits, before a byte of the body is read
    1 read          the body, bounded, then parsed by the API's wire adapter (Edge.read, Edge.parse)
    2 analyze       hints, exact or approximate prompt hashes, the session's records (reads only)
    3 decide        the routing core: the router, or the owner engine of a stored response
    4 admit         the tenant's token estimate settled; the gateway's and the engine's limits
    5 commit        the routing core's on_routed: index, home, sibling (only now)
    6 forward       the body the engine gets; one retry on another engine before the first byte
    7 relay         chunks to the client as they arrive (Edge.send)
    8 settle        the routing core's on_finished, the planner; counted once

A turn refused or abandoned before step 5 writes nothing about its session; one that was
committed is settled exactly once, however it ends (answered, engine failure, client gone,
cancelled). Stages are the service's modules (:mod:`.prompts`, :mod:`.placement`,
:mod:`.admission`, :mod:`.forwarding`); none calls back into the edge. The edge
(``gateway/api/relay.py``) authenticates the caller, implements :class:`Edge` in its API's shape
(errors, stream error events) and calls :meth:`Turns.run`. Errors reach it as exceptions to render
(the gateway's domain errors, :mod:`gateway.errors`, or a :class:`~gateway.core.hints.HintError`).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import httpx

from gateway.core.hints import HintError
from gateway.core.types import Decision
from gateway.errors import DomainError, ResponseNotFound, UpstreamFailed
from gateway.service.admission import Admission, TenantPass
from gateway.service.cluster import Cluster
from gateway.service.forwarding import Forwarder, Relay
from gateway.service.metrics import GatewayMetrics
from gateway.service.placement import Analysis, Placement
from gateway.service.responses import SCAN_BYTES, find_response_id
from gateway.service.tenants import Tenant
from gateway.service.usage import count_usage
from gateway.wire.openai import ParsedRequest

__all__ = ["REFUSALS", "Edge", "Route", "TurnStages", "Turns"]

log = logging.getLogger("agentgw.turns")

Headers = list[tuple[bytes, bytes]]

#: What a stage raises for the edge to render as the answer (nothing was sent yet).
REFUSALS = (DomainError, HintError)


@dataclass(frozen=True, slots=True)
class Route:
    """One generation API as the pipeline sees it."""

    label: str
    """The path it serves (the metrics label)."""
    upstream_path: str
    """The engine's path for it."""
    stores_responses: bool = False
    """The engine may store the answer (Responses API): the gateway records its id's engine."""
    stream_end: tuple[bytes, ...] = (b"data: [DONE]",)
    """What the stream's last event holds: once one has been relayed whole, the answer is
    delivered, and a client that leaves before the engine closes the stream is not a 499."""


class TurnStages(Protocol):
    """The service's stages a turn goes through (:class:`gateway.service.gateway.GatewayService`
    implements them over its parts)."""

    async def analyze(
        self,
        parsed: ParsedRequest,
        headers: Sequence[tuple[bytes, bytes]],
        dry_run: bool = ...,
        tenant: Tenant = ...,
    ) -> Analysis: ...

    def decide(self, a: Analysis) -> Decision: ...

    def pin_for(self, a: Analysis, d: Decision) -> dict[str, Any] | None: ...

    async def open(
        self,
        decision: Decision,
        path: str,
        body: bytes,
        headers: Sequence[tuple[bytes, bytes]],
        stream: bool = ...,
        continues: str | None = ...,
    ) -> Relay: ...

    async def remember_response(self, response_id: str, up: Relay, tenant: Tenant) -> None: ...


class Edge(Protocol):
    """The client's side of one turn, in its API's shape (implemented by the HTTP edge)."""

    @property
    def declared(self) -> int | None:
        """The body's declared length, if any (the tenant's token estimate before reading it)."""
        ...

    async def read(self) -> bytes:
        """The whole body (raises TooLarge past the size limit, Refused over the body budget;
        ConnectionAbortedError: the client left)."""
        ...

    def parse(self, raw: bytes) -> ParsedRequest:
        """The body through the API's wire adapter (raises BadRequest naming the field)."""
        ...

    async def wait_disconnect(self) -> None:
        """Returns when the client goes away (called once the body is read)."""
        ...

    async def refuse(self, exc: BaseException, headers: Headers) -> int:
        """Answer with ``exc`` rendered as the API's error; returns the status sent."""
        ...

    def reshape(self, status: int, body: bytes) -> bytes:
        """An engine's error body in the API's error shape."""
        ...

    def stream_error(self, message: str) -> bytes:
        """The event that ends a stream whose engine failed mid-response."""
        ...

    async def respond(self, status: int, headers: Headers, body: bytes) -> None:
        """A whole answer."""
        ...

    async def start(self, status: int, headers: Headers) -> None: ...

    async def send(self, chunk: bytes) -> None: ...

    async def end(self, tail: bytes = b"") -> None: ...

    def abort(self) -> None:
        """Cut the connection mid-response: the client sees a failed answer, never a short one
        that looks complete (no-op where the server cannot)."""
        ...


async def _after(first: bytes, rest: AsyncIterator[bytes]) -> AsyncIterator[bytes]:
    """``first``, then what is left of ``rest``."""
    yield first
    async for chunk in rest:
        yield chunk


class _Watch:
    """Cancels the task that runs the turn when the client disconnects."""

    def __init__(self, wait: Callable[[], Awaitable[None]]) -> None:
        self.gone = False
        self.done = False
        self._task = asyncio.current_task()
        self._fut = asyncio.ensure_future(wait())
        self._fut.add_done_callback(self._on_gone)

    def _on_gone(self, fut: asyncio.Future[None]) -> None:
        if fut.cancelled() or fut.exception() is not None or self.done or self._task is None:
            return
        self.gone = True
        self._task.cancel()

    def stop(self) -> None:
        self.done = True
        self._fut.cancel()

    def absorb(self) -> None:
        """The cancellation was ours (the client left): let the task go on to clean up."""
        if self._task is not None:
            self._task.uncancel()


@dataclass(slots=True)
class _Turn:
    """One turn as it goes: what the pipeline learnt and did so far."""

    tenant: Tenant
    raw: bytes
    t0: float
    entered: TenantPass | None = None
    """The tenant's pass (its limits checked before the body was read)."""
    parsed: ParsedRequest | None = None
    analysis: Analysis | None = None
    decision: Decision | None = None
    body: bytes = b""
    """What the engine gets."""
    extra_headers: Headers = field(default_factory=list)
    committed: bool = False
    """The routing core's state and the session record were written (settled exactly once)."""
    settled: bool = False
    counted: bool = False

    @property
    def pool(self) -> str:
        return self.decision.pool if self.decision is not None else ""

    def response_headers(self, up: Relay) -> Headers:
        d = self.decision
        assert d is not None and self.analysis is not None
        reason = d.reason if not up.retried else "retry"
        out = [
            (b"x-agentgw-engine", up.engine.encode()),
            (b"x-agentgw-pool", up.pool.encode()),
            (b"x-agentgw-reason", reason.encode()),
            (b"x-agentgw-cached-tokens-est", str(d.cached_tokens).encode()),
        ]
        sid = self.analysis.hints.session_id
        local = self.tenant.local_id(sid) if sid is not None else None
        if local is not None:
            out.append((b"x-agentgw-session", local.encode()))
        if self.analysis.store_local:  # placed on this replica's view alone (the store was down)
            out.append((b"x-agentgw-session-store", b"local"))
        return out + self.extra_headers


class Turns:
    """A generation request's life, stage by stage, over what it uses: the service's stages
    (:class:`TurnStages`), admission, placement, the forwarder, the cluster and the metrics."""

    def __init__(
        self,
        stages: TurnStages,
        admission: Admission,
        placement: Placement,
        forwarder: Forwarder,
        cluster: Cluster,
        metrics: GatewayMetrics,
    ) -> None:
        self.stages = stages
        self.admission = admission
        self.placement = placement
        self.forwarder = forwarder
        self.cluster = cluster
        self.metrics = metrics

    async def run(
        self, route: Route, tenant: Tenant, headers: Sequence[tuple[bytes, bytes]], edge: Edge
    ) -> None:
        """One turn, start to end; what the client gets goes out through ``edge``."""
        t0 = time.perf_counter()
        try:
            # a refused request costs its headers, not a read, a parse and an analysis
            entered = self.admission.enter_body(tenant, edge.declared)
        except REFUSALS as exc:
            await self._refuse(route, _Turn(tenant, b"", t0), edge, exc, [])
            return
        try:
            await self._run(route, tenant, headers, edge, entered, t0)
        finally:
            entered.leave()

    async def _run(
        self,
        route: Route,
        tenant: Tenant,
        headers: Sequence[tuple[bytes, bytes]],
        edge: Edge,
        entered: TenantPass,
        t0: float,
    ) -> None:
        try:
            raw = await edge.read()
        except ConnectionAbortedError:
            return
        except REFUSALS as exc:
            await self._refuse(route, _Turn(tenant, b"", t0), edge, exc, [])
            return
        turn = _Turn(tenant, raw, t0, entered=entered)
        watch = _Watch(edge.wait_disconnect)  # from now on a client that leaves cancels the turn
        try:
            await self._stages(route, turn, headers, edge, watch)
        except asyncio.CancelledError:
            if not watch.gone:
                raise  # cancelled from outside (the drain's deadline): the edge ends the answer
            watch.absorb()
            if not turn.counted:
                turn.counted = True
                self.metrics.count_request(route.label, "499", turn.pool, "")
        finally:
            watch.stop()
            if turn.committed and not turn.settled:  # it never reached an engine
                assert turn.analysis is not None and turn.decision is not None
                turn.settled = True
                await self.placement.settle(turn.analysis, turn.decision, None, ok=False)

    async def _refuse(
        self, route: Route, turn: _Turn, edge: Edge, exc: BaseException, headers: Headers
    ) -> None:
        turn.counted = True
        status = await edge.refuse(exc, headers)
        self.metrics.count_request(route.label, str(status), turn.pool, "")

    async def _stages(
        self,
        route: Route,
        turn: _Turn,
        headers: Sequence[tuple[bytes, bytes]],
        edge: Edge,
        watch: _Watch,
    ) -> None:
        try:
            # a burst is parsed and analysed over several loop iterations
            await self.admission.turnstile.enter()
            turn.parsed = parsed = edge.parse(turn.raw)
            turn.analysis = a = await self.stages.analyze(parsed, headers, tenant=turn.tenant)
            turn.decision = d = self.stages.decide(a)
            # the body the engine gets, before anything is written: one that cannot be
            # forwarded is a 400 that leaves no session state behind
            salt = turn.tenant.cache_salt  # the tenant's, never the client's
            pin = self.stages.pin_for(a, d)
            turn.body = self.forwarder.body(
                parsed.body, turn.raw, a.hints, pin, changed=salt is not None, salt=salt
            )
        except REFUSALS as exc:
            await self._refuse(route, turn, edge, exc, [])
            return
        warning = a.prompt.warning
        if warning:
            turn.extra_headers.append((b"x-agentgw-warning", warning.encode("latin-1", "replace")))
        interactive = a.hints.interactive
        async with contextlib.AsyncExitStack() as admitted:
            try:
                # the gateway's limits (the tenant's were checked before the body), then the
                # engine's; interactive turns first
                await admitted.enter_async_context(
                    self.admission.admit(
                        turn.tenant,
                        interactive,
                        a.request.prompt_tokens,
                        entered=turn.entered,
                        key=a.hints.session_id,
                    )
                )
                await admitted.enter_async_context(
                    self.admission.engine_slot(d.engine, interactive, turn.tenant)
                )
                turn.committed = True
                await self.placement.place(a, d)
            except REFUSALS as exc:
                await self._refuse(route, turn, edge, exc, turn.extra_headers)
                return
            await self._forward(route, turn, headers, edge, watch)

    async def _forward(
        self,
        route: Route,
        turn: _Turn,
        headers: Sequence[tuple[bytes, bytes]],
        edge: Edge,
        watch: _Watch,
    ) -> None:
        a, d, parsed = turn.analysis, turn.decision, turn.parsed
        assert a is not None and d is not None and parsed is not None
        try:
            up = await self.stages.open(
                d,
                route.upstream_path,
                turn.body,
                self.forwarder.headers(headers),
                parsed.stream,
                continues=parsed.previous_response_id,
            )
        except REFUSALS as exc:
            await self._refuse(route, turn, edge, exc, turn.extra_headers)
            return
        try:
            if up.status >= 400:
                await self._relay_error(route, turn, up, edge)
                return
            record = route.stores_responses and parsed.store and up.status == 200
            await self._relay(route, turn, up, edge, watch, record)
        finally:
            await up.aclose()

    async def _settle(self, route: Route, turn: _Turn, up: Relay, status: str) -> None:
        """The engine answered (whole, in part, or with an error): count the turn, settle it."""
        assert turn.analysis is not None and turn.decision is not None
        self.metrics.observe_e2e(route.label, time.perf_counter() - turn.t0)
        self.metrics.count_request(route.label, status, up.pool, up.engine)
        turn.counted = turn.settled = True
        up.finished()
        self.cluster.end(up.engine)
        a, d = turn.analysis, turn.decision
        count_usage(self.metrics, turn.tenant.name, status, up.tail, a.request.prompt_tokens, d.cached_tokens)
        await self.placement.settle(turn.analysis, turn.decision, up.engine, ok=status.startswith("2"))

    async def _relay_error(self, route: Route, turn: _Turn, up: Relay, edge: Edge) -> None:
        """An engine's error answer, re-shaped into the API's error shape (vLLM's own errors are
        ``{"detail": ...}`` on some paths). The owner's 404 for a ``previous_response_id`` (it
        evicted the response) becomes OpenAI's 400 ``previous_response_not_found``, as when the
        gateway knows no owner."""
        status = "502"
        assert turn.parsed is not None
        continues = turn.parsed.previous_response_id
        try:
            raw = await up.read()
            if up.status == 404 and continues is not None:
                gone = ResponseNotFound(continues, "previous_response_id", "its engine no longer holds it")
                status = str(await edge.refuse(gone, turn.response_headers(up)))
            else:
                body = edge.reshape(up.status, raw)
                headers = [
                    (b"content-type", b"application/json"),
                    (b"content-length", str(len(body)).encode()),
                    *turn.response_headers(up),
                ]
                await edge.respond(up.status, headers, body)
                status = str(up.status)
        except (TimeoutError, httpx.TransportError) as exc:
            self.metrics.upstream_errors.labels(up.engine, type(exc).__name__).inc()
            await edge.refuse(UpstreamFailed(f"engine '{up.engine}' failed mid-response: {exc!r}", False), [])
        except OSError:
            status = "499"
        finally:
            await self._settle(route, turn, up, status)

    async def _relay(
        self, route: Route, turn: _Turn, up: Relay, edge: Edge, watch: _Watch, record_id: bool
    ) -> None:
        assert turn.parsed is not None
        stream = turn.parsed.stream
        headers = up.headers() + turn.response_headers(up)
        status = str(up.status)
        started = False
        first = True
        head = b""
        delivered = False  # the stream's last event has been relayed whole
        ends = route.stream_end if stream else ()
        chunks = up.chunks()
        try:
            if not stream:
                # a whole answer's status line waits for its first bytes: an engine failing
                # before them is a 502 in the API's shape, not a 200 with an empty body
                async for chunk in chunks:
                    chunks = _after(chunk, chunks)
                    break
            await edge.start(up.status, headers)
            started = True
            async for chunk in chunks:
                if first:
                    self.metrics.observe_ttft(route.label, time.perf_counter() - turn.t0)
                    first = False
                if record_id:
                    head += chunk
                    rid = find_response_id(head)
                    if rid is not None or len(head) >= SCAN_BYTES:
                        record_id = False
                        if rid is not None:
                            await self.stages.remember_response(rid, up, turn.tenant)
                await edge.send(chunk)
                if ends and not delivered and chunk.endswith(b"\n\n") and any(e in chunk for e in ends):
                    delivered = True
            watch.done = True
            await edge.end()
        except asyncio.CancelledError:
            if not watch.gone:
                status = "503"  # cancelled from outside (the drain's deadline): the edge ends it
                raise
            if not delivered:
                status = "499"
                self.metrics.client_disconnects.labels(up.engine).inc()
            watch.absorb()
        except (TimeoutError, httpx.TransportError) as exc:
            status = "502"
            watch.stop()
            self.metrics.upstream_errors.labels(up.engine, type(exc).__name__).inc()
            # died or froze: ejected; whether it still listens, the next probe says
            self.cluster.record_connect_failure(up.engine, refused=False)
            log.warning("upstream %s failed mid-response: %r", up.engine, exc)
            message = f"engine '{up.engine}' failed mid-response: {exc!r}"
            with contextlib.suppress(Exception):
                if not started:  # nothing sent yet: the API's error
                    await edge.refuse(UpstreamFailed(message, False), turn.response_headers(up))
                elif stream:  # the API's error event ends the stream
                    await edge.end(edge.stream_error(message))
                else:
                    # part of a whole answer is out: cut the connection before its end, so the
                    # client sees a failure, never a short answer that looks complete
                    edge.abort()
        except OSError:
            # the server's send() raised (ASGI 2.4: the client connection is closed) before the
            # disconnect watcher fired: the same outcome
            if not delivered:
                status = "499"
                self.metrics.client_disconnects.labels(up.engine).inc()
        finally:
            watch.stop()
            await self._settle(route, turn, up, status)
