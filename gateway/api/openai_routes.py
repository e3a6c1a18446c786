"""The hot path: ``POST /v1/chat/completions`` and ``POST /v1/completions`` as raw ASGI endpoints.

They bypass Starlette's Request/StreamingResponse (a measurable cost per chunk, ANCHORS.md):
read the body, parse it once, ask the service where it goes, then relay each upstream chunk to
the client as soon as it arrives. A client that disconnects mid-stream cancels the relay, which
closes the upstream connection, so vLLM aborts the request and frees its KV.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from typing import Any

import aiohttp

from gateway.errors import ApiError
from gateway.protocol import parse_body
from gateway.service.gateway import GatewayService, Plan, Relay
from gateway.service.proxy import RESPONSE_DROP

log = logging.getLogger("agentgw.api")

Scope = dict[str, Any]


class ServiceHolder:
    """Where the lifespan puts the app's service for the hot endpoints (a plain attribute:
    Starlette's ``State.__getattr__`` was a measurable per-request cost)."""

    service: GatewayService | None = None


async def read_body(receive: Any, limit: int) -> bytes:
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
        chunks.append(chunk)
        if not message.get("more_body", False):
            return chunks[0] if len(chunks) == 1 else b"".join(chunks)


async def wait_disconnect(receive: Any) -> None:
    """Return when the client goes away. Any other message is skipped, as Starlette's
    ``listen_for_disconnect`` does, so one unexpected message cannot leave the relay blind to a
    later disconnect."""
    while (await receive())["type"] != "http.disconnect":
        pass


async def send_error(send: Any, err: ApiError, extra: list[tuple[bytes, bytes]] | None = None) -> None:
    body = err.body()
    headers = [*err.headers(), (b"content-length", str(len(body)).encode()), *(extra or [])]
    await send({"type": "http.response.start", "status": err.status, "headers": headers})
    await send({"type": "http.response.body", "body": body})


class CompletionsEndpoint:
    """One OpenAI generation route (``kind`` is ``chat`` or ``completions``)."""

    def __init__(self, kind: str, path: str, holder: ServiceHolder) -> None:
        self.kind = kind
        self.path = path
        self.route = path
        self._holder = holder

    async def __call__(self, scope: Scope, receive: Any, send: Any) -> None:
        svc = self._holder.service
        if svc is None:
            await send_error(send, ApiError(503, "the gateway is starting", None, "starting", retry_after=1))
            return
        t0 = time.perf_counter()
        try:
            raw = await read_body(receive, svc.config.limits.max_body_bytes)
            parsed = parse_body(self.kind, raw)
            plan = await svc.plan(parsed, raw, scope["headers"])
        except ConnectionAbortedError:
            return
        except ApiError as err:
            svc.metrics.count_request(self.route, str(err.status), "", "")
            await send_error(send, err)
            return
        try:
            up = await svc.open(plan.decision, self.path, plan.body, plan.headers)
        except ApiError as err:
            await svc.abandon(plan)
            svc.metrics.count_request(self.route, str(err.status), plan.decision.pool, "")
            await send_error(send, err, plan.extra_headers)
            return
        try:
            await self._relay(svc, plan, up, t0, receive, send)
        finally:
            # release() returns a fully read connection to the pool; close() drops one that is
            # mid-response (a client went away), which makes vLLM abort the request
            if up.response.content.at_eof():
                up.response.release()
            else:
                up.response.close()

    async def _relay(
        self, svc: GatewayService, plan: Plan, up: Relay, t0: float, receive: Any, send: Any
    ) -> None:
        resp = up.response
        headers = [(k.lower(), v) for k, v in resp.raw_headers if k.lower() not in RESPONSE_DROP]
        headers += plan.response_headers(up)
        await send({"type": "http.response.start", "status": resp.status, "headers": headers})

        me = asyncio.current_task()
        state = {"done": False, "gone": False}

        def on_gone(fut: asyncio.Future[Any]) -> None:
            if fut.cancelled() or fut.exception() is not None or state["done"] or me is None:
                return
            state["gone"] = True
            me.cancel()

        watch = asyncio.ensure_future(wait_disconnect(receive))
        watch.add_done_callback(on_gone)
        first = True
        status = str(resp.status)
        try:
            async for chunk in resp.content.iter_any():
                if first:
                    svc.metrics.observe_ttft(self.route, time.perf_counter() - t0)
                    first = False
                await send({"type": "http.response.body", "body": chunk, "more_body": True})
            state["done"] = True
            await send({"type": "http.response.body", "body": b"", "more_body": False})
        except asyncio.CancelledError:
            if not state["gone"]:
                raise
            status = "499"
            svc.metrics.client_disconnects.labels(up.engine).inc()
            uncancel = getattr(me, "uncancel", None)
            if uncancel is not None:
                uncancel()
        except (TimeoutError, aiohttp.ClientError) as exc:
            status = "502"
            svc.metrics.upstream_errors.labels(up.engine, type(exc).__name__).inc()
            log.warning("upstream %s failed mid-response: %r", up.engine, exc)
            with contextlib.suppress(Exception):
                await send({"type": "http.response.body", "body": b"", "more_body": False})
        except OSError:
            # the server's send() raised (ASGI 2.4: the client connection is closed) before the
            # disconnect watcher fired: the same outcome
            status = "499"
            svc.metrics.client_disconnects.labels(up.engine).inc()
        finally:
            state["done"] = True
            watch.cancel()
            svc.metrics.observe_e2e(self.route, time.perf_counter() - t0)
            svc.metrics.count_request(self.route, status, up.pool, up.engine)
            await svc.finish(plan, up, status)
