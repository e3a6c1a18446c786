"""Forwarding: what is sent to the chosen engine and how. Rewrites the body (gateway-only fields
out; engine_ext's pin request and the hinted priority in), filters the headers, and opens the
upstream response with one retry on another engine of the pool when the first cannot be reached
before any byte (an engine that refuses or resets at once does not use the retry up). What comes back is a :class:`Relay`: the engine's status, headers and an async
iterator of body chunks, independent of any wire API; the edge relays it in its own shape. The
relay reports its request's phases to the cluster's load ledger: prefilling (with the decision's
uncached tokens) from the send, decoding from the first body chunk, over when the turn finishes.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections import deque
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import aiohttp
import orjson
from multidict import CIMultiDict

from gateway.config import GatewayConfig, TimeoutsConfig
from gateway.core.hints import GATEWAY_BODY_KEYS, HINT_HEADERS, AgentHints
from gateway.core.load import Ticket
from gateway.core.types import Decision
from gateway.errors import ApiError
from gateway.service.cluster import Cluster
from gateway.service.errors import UpstreamFailed
from gateway.service.metrics import GatewayMetrics
from gateway.service.proxy import CONNECT_ERRORS, HOP_HEADERS, RESPONSE_DROP, Upstream
from gateway.service.tenants import CREDENTIAL_HEADERS

__all__ = ["Forwarder", "Relay"]

log = logging.getLogger("agentgw.forwarding")

TAIL_CHUNKS = 3
"""Chunks of each answer kept for its usage report (a stream's usage chunk is next to its end)."""

_DROP_HEADERS = HOP_HEADERS | {b"content-type"} | {h.encode() for h in HINT_HEADERS} | CREDENTIAL_HEADERS


def _refused(exc: BaseException) -> bool:
    """Did the engine refuse the connection (nothing listens)? A timeout, a reset or a closed
    keep-alive connection does not say so."""
    if isinstance(exc, aiohttp.ClientConnectorError):
        return isinstance(exc.os_error, ConnectionRefusedError)
    return not isinstance(exc, (TimeoutError, aiohttp.ClientOSError, aiohttp.ServerDisconnectedError))


@dataclass(slots=True)
class Relay:
    """An open upstream response being relayed."""

    engine: str
    pool: str
    response: aiohttp.ClientResponse
    retried: bool
    cluster: Cluster | None = None
    ticket: Ticket | None = None
    """The request's place in the cluster's load ledger (prefilling until the first chunk)."""
    tail: deque[bytes] = field(default_factory=lambda: deque(maxlen=TAIL_CHUNKS))
    """The last chunks relayed: where the answer's usage report is (gateway/service/usage.py)."""

    @property
    def status(self) -> int:
        return self.response.status

    def headers(self) -> list[tuple[bytes, bytes]]:
        """The engine's response headers worth relaying (lowercase names)."""
        return [(k.lower(), v) for k, v in self.response.raw_headers if k.lower() not in RESPONSE_DROP]

    def chunks(self) -> AsyncIterator[bytes]:
        return self._first_then(self.response.content.iter_any())

    async def _first_then(self, it: AsyncIterator[bytes]) -> AsyncIterator[bytes]:
        keep = self.tail.append
        async for chunk in it:
            self.prefilled()
            keep(chunk)
            yield chunk
            break
        async for chunk in it:
            keep(chunk)
            yield chunk

    def prefilled(self) -> None:
        """The first body byte arrived: the request decodes from now on."""
        if self.ticket is not None and self.cluster is not None:
            self.cluster.first_byte(self.ticket)

    def finished(self) -> None:
        """The request is over: out of the load ledger (idempotent)."""
        if self.ticket is not None and self.cluster is not None:
            self.cluster.finished(self.ticket)

    async def read(self) -> bytes:
        return await self.response.read()

    def close(self) -> None:
        """Return a fully read connection to the pool; drop one that is mid-response (the client
        went away), which makes vLLM abort the request."""
        if self.response.content.at_eof():
            self.response.release()
        else:
            self.response.close()


class Forwarder:
    def __init__(
        self, config: GatewayConfig, upstream: Upstream, cluster: Cluster, metrics: GatewayMetrics
    ) -> None:
        self.config = config
        self.upstream = upstream
        self.cluster = cluster
        self.metrics = metrics
        t = config.timeouts
        self._stream_timeout = aiohttp.ClientTimeout(sock_connect=t.connect_s, sock_read=t.inter_chunk_s)

    @staticmethod
    def headers(headers: Sequence[tuple[bytes, bytes]]) -> list[tuple[bytes, bytes]]:
        fwd = [(k, v) for k, v in headers if k not in _DROP_HEADERS]
        fwd.append((b"content-type", b"application/json"))
        return fwd

    def body(
        self,
        body: dict[str, Any],
        raw: bytes,
        hints: AgentHints,
        pin: dict[str, Any] | None,
        changed: bool = False,
    ) -> bytes:
        """The body the engine gets: ``raw`` unless something had to change (``changed``: the
        caller changed ``body`` already). ``pin`` is engine_ext's ``kv_transfer_params.agentgw``
        for this turn (None: none). A client's own ``kv_transfer_params.agentgw`` never reaches
        engine_ext: it could pin, release or evict another session's KV."""
        kv = body.get("kv_transfer_params")
        if isinstance(kv, dict) and "agentgw" in kv:
            rest = {k: v for k, v in kv.items() if k != "agentgw"}
            body = {k: v for k, v in body.items() if k != "kv_transfer_params"}
            if rest:
                body["kv_transfer_params"] = rest
            kv = rest or None
            changed = True
        elif kv is not None and not isinstance(kv, dict):
            kv = None
        if pin is not None:
            body = {**body, "kv_transfer_params": {**(kv or {}), "agentgw": pin}}
            changed = True
        for key in GATEWAY_BODY_KEYS:
            if key in body:
                body = {k: v for k, v in body.items() if k != key}
                changed = True
        xargs = body.get("vllm_xargs")
        if isinstance(xargs, dict) and "agentic_context" in xargs:
            rest = {k: v for k, v in xargs.items() if k != "agentic_context"}
            body = (
                {**body, "vllm_xargs": rest} if rest else {k: v for k, v in body.items() if k != "vllm_xargs"}
            )
            changed = True
        if self.config.routing.forward_priority and hints.priority is not None and "priority" not in body:
            body = {**body, "priority": hints.priority}
            changed = True
        return _dumps(body) if changed else raw

    async def open(
        self,
        decision: Decision,
        path: str,
        body: bytes,
        headers: Sequence[tuple[bytes, bytes]],
        stream: bool = False,
    ) -> Relay:
        """Send the request; when the engine cannot be reached or sends no response headers
        within ``first_byte_s`` (a frozen engine), retry once on another engine of the same
        pool (the best fallback routable then; past one that refuses or resets, the next), then
        give up (:class:`UpstreamFailed`). A connect timeout the loop's lag explains is tried
        again on the same engine (``LAG_RETRIES``). A streamed response may then fall silent
        for ``inter_chunk_s`` at most, a non-streamed one for ``read_s``."""
        t = self.config.timeouts
        timeout = self._stream_timeout if stream else self.upstream.timeout
        hdrs = CIMultiDict((k.decode("latin-1"), v.decode("latin-1")) for k, v in headers)
        last: BaseException | None = None
        lag_retries = 0
        tried: set[str] = set()
        tries = [decision.engine]
        while tries:
            name = tries.pop(0)
            if name != decision.engine and not self.cluster.routable(name):
                continue
            state = self.cluster.engines[name]
            self.cluster.begin(name)
            # a fallback engine's prefix match is not known: its whole prompt counts
            fallback = name != decision.engine
            uncached = decision.uncached_tokens + (decision.cached_tokens if fallback else 0)
            ticket = self.cluster.sent(name, uncached, decision.cached_tokens + decision.uncached_tokens)
            try:
                async with asyncio.timeout(t.first_byte_s):
                    response = await self.upstream.session.post(
                        state.config.url + path, data=body, headers=hdrs, timeout=timeout
                    )
            except CONNECT_ERRORS as exc:
                self.cluster.finished(ticket)
                self.cluster.end(name)
                # a timeout may be the gateway's own lag; a refusal or a reset is the engine's
                excused = self.cluster.record_connect_failure(name, _timeout_s(exc, t), refused=_refused(exc))
                last = exc
                if excused and isinstance(exc, aiohttp.ConnectionTimeoutError):
                    # nothing was sent: the same engine again, once the loop catches up
                    self.metrics.upstream_errors.labels(name, "connect_lag").inc()
                    if lag_retries < LAG_RETRIES:
                        lag_retries += 1
                        tries.insert(0, name)
                        continue
                else:
                    self.metrics.upstream_errors.labels(name, "connect").inc()
                    log.warning("connect to %s failed: %r", name, exc)
                tried.add(name)
                # one retry on another engine; a fallback that failed at once (refused: nothing
                # listens, or reset: an engine killed since the decision, not yet ejected) does
                # not use it up, the next routable one is tried; a timeout does (the time is
                # spent). Each engine once: bounded by the pool's size.
                if len(tried) == 1 or (fallback and _timeout_s(exc, t) is None):
                    nxt = self._fallback(decision, tried)
                    if nxt is not None:
                        tries.append(nxt)
                continue
            except aiohttp.ClientError as exc:
                self.cluster.finished(ticket)
                self.cluster.end(name)
                self.metrics.upstream_errors.labels(name, type(exc).__name__).inc()
                raise UpstreamFailed(f"engine '{name}' failed before responding: {exc!r}", False) from None
            except BaseException:
                self.cluster.finished(ticket)
                self.cluster.end(name)  # cancelled (the client left) while connecting
                raise
            return Relay(name, state.pool, response, retried=fallback, cluster=self.cluster, ticket=ticket)
        raise UpstreamFailed(f"could not connect to any engine of pool '{decision.pool}': {last!r}", True)

    def _fallback(self, decision: Decision, tried: set[str]) -> str | None:
        """The best fallback not tried yet that is routable now (the decision's first one may be
        the engine that just died, not yet ejected when the decision was made)."""
        for f in decision.fallbacks:
            if f not in tried and f != decision.engine and self.cluster.routable(f):
                return f
        return None

    async def call(self, engine: str, method: str, path: str, body: bytes | None) -> tuple[int, bytes]:
        """One whole request to one engine (no retry: the caller chose the engine for a reason)."""
        state = self.cluster.engines[engine]
        self.cluster.begin(engine)
        try:
            async with self.upstream.session.request(
                method,
                state.config.url + path,
                data=body,
                headers={"content-type": "application/json"},
                timeout=self.upstream.timeout,
            ) as r:
                return r.status, await r.read()
        except (aiohttp.ClientError, TimeoutError) as exc:
            self.metrics.upstream_errors.labels(engine, type(exc).__name__).inc()
            raise UpstreamFailed(
                f"engine '{engine}' failed: {exc!r}", isinstance(exc, CONNECT_ERRORS)
            ) from None
        finally:
            self.cluster.end(engine)


def _dumps(body: dict[str, Any]) -> bytes:
    """The re-serialized body. orjson writes at most 255 levels of nesting but parses 1,024: a
    deeper body that passed the parse (and had to change) is written by the standard library,
    or refused in the API's shape when even that cannot (never a 500)."""
    try:
        return orjson.dumps(body)
    except orjson.JSONEncodeError:
        pass
    try:
        return json.dumps(body, ensure_ascii=False, separators=(",", ":")).encode("utf-8", "surrogatepass")
    except RecursionError:
        raise ApiError(400, "the request body nests JSON too deeply", None, "invalid_json") from None
    except (TypeError, ValueError) as exc:
        raise ApiError(
            400, f"the request body cannot be forwarded as JSON: {exc}", None, "invalid_json"
        ) from None


LAG_RETRIES = 3
"""Connects retried on the same engine per request when the event loop's lag timed them out."""


def _timeout_s(exc: BaseException, t: TimeoutsConfig) -> float | None:
    """The limit a connect-phase timeout ran out of; None for a refusal or a reset."""
    if isinstance(exc, aiohttp.ConnectionTimeoutError):
        return t.connect_s
    if isinstance(exc, TimeoutError):
        return t.first_byte_s
    return None
