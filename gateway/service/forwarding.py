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

import httpx
import orjson

from gateway.config import GatewayConfig, TimeoutsConfig
from gateway.core.hints import GATEWAY_BODY_KEYS, AgentHints
from gateway.core.load import Ticket
from gateway.core.types import Decision
from gateway.errors import BadRequest, UpstreamFailed
from gateway.service.cluster import Cluster
from gateway.service.http1 import RawResponse, request_head
from gateway.service.metrics import GatewayMetrics
from gateway.service.proxy import CONNECT_ERRORS, RESPONSE_DROP, ConnectionRefused, Upstream

__all__ = ["Forwarder", "Relay"]

log = logging.getLogger("agentgw.forwarding")

TAIL_CHUNKS = 3
"""Chunks of each answer kept for its usage report (a stream's usage chunk is next to its end)."""

STEERING_FIELDS = ("kv_transfer_params", "ec_transfer_params", "cache_salt", "priority", "kv_hints")
"""Body fields that steer an engine (its KV connector, its prefix-cache namespace, its queue; a
KV hint envelope, should vLLM read one from the body): sent only as the gateway sets them
(:meth:`Forwarder.body`)."""
STEERING_XARGS = ("kv_transfer_params", "ec_transfer_params", "agentic_context")
"""The same inside ``vllm_xargs`` (vLLM copies them into the request's extra args), and the
Dynamo hint block, which is the gateway's."""
DROPPED_FIELDS = (*GATEWAY_BODY_KEYS, *STEERING_FIELDS)

FORWARDED_HEADERS = frozenset(
    {
        b"accept",
        b"user-agent",
        b"x-request-id",
        b"traceparent",
        b"tracestate",
        b"baggage",
        b"anthropic-version",
        b"anthropic-beta",
        b"openai-beta",
    }
)
"""Request headers an engine gets (lowercase; with the gateway's ``content-type``). An
allow-list: hop-by-hop headers (``Connection`` and the ones it names), credentials
(``Authorization``, ``x-api-key``, ``Proxy-Authorization``, ``Cookie``), hint headers and
anything an engine might act on (``X-data-parallel-rank``) stay at the gateway."""


def _refused(exc: BaseException) -> bool:
    """Did the engine refuse the connection (nothing listens)? A timeout, a reset or a closed
    keep-alive connection does not say so."""
    return isinstance(exc, ConnectionRefused)


@dataclass(slots=True)
class Relay:
    """An open upstream response being relayed."""

    engine: str
    pool: str
    response: httpx.Response | RawResponse
    retried: bool
    cluster: Cluster | None = None
    ticket: Ticket | None = None
    """The request's place in the cluster's load ledger (prefilling until the first chunk)."""
    tail: deque[bytes] = field(default_factory=lambda: deque(maxlen=TAIL_CHUNKS))
    """The last chunks relayed: where the answer's usage report is (gateway/service/usage.py)."""

    @property
    def status(self) -> int:
        return self.response.status_code

    def headers(self) -> list[tuple[bytes, bytes]]:
        """The engine's response headers worth relaying (lowercase names)."""
        return [(k.lower(), v) for k, v in self.response.headers.raw if k.lower() not in RESPONSE_DROP]

    def chunks(self) -> AsyncIterator[bytes]:
        """The body as it arrives (raises ``httpx.TransportError`` when the engine fails)."""
        return self._first_then(aiter(self.response.stream))  # type: ignore[arg-type]

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
        return await self.response.aread()

    async def aclose(self) -> None:
        """Return a fully read connection to the pool; drop one that is mid-response (the client
        went away), which makes vLLM abort the request."""
        await self.response.aclose()


class Forwarder:
    def __init__(
        self, config: GatewayConfig, upstream: Upstream, cluster: Cluster, metrics: GatewayMetrics
    ) -> None:
        self.config = config
        self.upstream = upstream
        self.cluster = cluster
        self.metrics = metrics
        t = config.timeouts
        self._stream_timeout = {"connect": t.connect_s, "read": t.inter_chunk_s, "pool": t.connect_s}
        self._whole_timeout = upstream.timeout.as_dict()
        self._urls: dict[tuple[str, str], httpx.URL] = {}
        self._targets: dict[tuple[str, str], tuple[str, int, bool, bytes, bytes]] = {}

    @staticmethod
    def headers(headers: Sequence[tuple[bytes, bytes]]) -> list[tuple[bytes, bytes]]:
        """The request headers an engine gets: :data:`FORWARDED_HEADERS` only (ASGI servers
        give names in lowercase), and the gateway's ``content-type``."""
        fwd = [(k, v) for k, v in headers if k in FORWARDED_HEADERS]
        fwd.append((b"content-type", b"application/json"))
        return fwd

    def body(
        self,
        body: dict[str, Any],
        raw: bytes,
        hints: AgentHints,
        pin: dict[str, Any] | None,
        changed: bool = False,
        salt: str | None = None,
    ) -> bytes:
        """The body the engine gets: ``raw`` unless something had to change (``changed``: the
        caller changed ``body`` already). ``pin`` is engine_ext's ``kv_transfer_params`` for
        this turn (None: none); ``salt`` the tenant's prefix-cache salt (None: none).

        Fields that steer an engine (:data:`STEERING_FIELDS`, :data:`STEERING_XARGS`) reach it
        only as the gateway sets them, never as a client sent them: a client's
        ``kv_transfer_params`` could point vLLM's KV connector at another host
        (``remote_host``, ``do_remote_prefill``) or, with ``agentgw``, pin, release or evict
        another session's KV; ``vllm_xargs.kv_transfer_params`` is copied by vLLM into the
        same place; ``priority`` would jump another tenant's queue; ``cache_salt`` is the
        tenant's or none."""
        drop = [k for k in DROPPED_FIELDS if k in body]
        if drop:
            body = {k: v for k, v in body.items() if k not in drop}
            changed = True
        xargs = body.get("vllm_xargs")
        if isinstance(xargs, dict) and any(k in xargs for k in STEERING_XARGS):
            rest = {k: v for k, v in xargs.items() if k not in STEERING_XARGS}
            body = (
                {**body, "vllm_xargs": rest} if rest else {k: v for k, v in body.items() if k != "vllm_xargs"}
            )
            changed = True
        if salt is not None:
            body = {**body, "cache_salt": salt}
            changed = True
        if pin is not None:
            body = {**body, "kv_transfer_params": pin}
            changed = True
        if self.config.routing.forward_priority and hints.priority is not None:
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
        timeout = self._stream_timeout if stream else self._whole_timeout
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
                response: httpx.Response | RawResponse
                fast = self.upstream.fast
                if fast is not None:
                    host, port, tls, host_header, target = self._target(state.config.url, path)
                    head = request_head("POST", target, host_header, list(headers), len(body))
                    async with asyncio.timeout(t.first_byte_s):
                        response = await fast.send_raw(host, port, tls, head, body, timeout)
                else:
                    request = httpx.Request(
                        "POST",
                        self._url(state.config.url, path),
                        content=body,
                        headers=headers,
                        extensions={"timeout": timeout},
                    )
                    async with asyncio.timeout(t.first_byte_s):
                        response = await self.upstream.send(request)
            except CONNECT_ERRORS as exc:
                self.cluster.finished(ticket)
                self.cluster.end(name)
                # a timeout may be the gateway's own lag; a refusal or a reset is the engine's
                excused = self.cluster.record_connect_failure(name, _timeout_s(exc, t), refused=_refused(exc))
                last = exc
                if excused and isinstance(exc, httpx.ConnectTimeout):
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
            except httpx.TransportError as exc:
                self.cluster.finished(ticket)
                self.cluster.end(name)
                self.metrics.upstream_errors.labels(name, type(exc).__name__).inc()
                raise UpstreamFailed(f"engine '{name}' failed before responding: {exc!r}", False) from None
            except BaseException:
                self.cluster.finished(ticket)
                self.cluster.end(name)  # cancelled (the client left) while connecting
                raise
            return Relay(name, state.pool, response, retried=fallback, cluster=self.cluster, ticket=ticket)
        raise UpstreamFailed(
            f"could not connect to any engine of pool '{decision.pool}': {last!r}",
            True,
            timed_out=last is not None and _timeout_s(last, t) is not None,
            refused=last is not None and _refused(last),
        )

    def _fallback(self, decision: Decision, tried: set[str]) -> str | None:
        """The best fallback not tried yet that is routable now (the decision's first one may be
        the engine that just died, not yet ejected when the decision was made)."""
        for f in decision.fallbacks:
            if f not in tried and f != decision.engine and self.cluster.routable(f):
                return f
        return None

    def _url(self, base: str, path: str) -> httpx.URL:
        """An engine's URL for ``path`` (parsed once: a measurable cost per request)."""
        url = self._urls.get((base, path))
        if url is None:
            if len(self._urls) >= 1024:
                self._urls.clear()
            url = self._urls[(base, path)] = httpx.URL(base + path)
        return url

    def _target(self, base: str, path: str) -> tuple[str, int, bool, bytes, bytes]:
        """An engine's (host, port, TLS, Host header, request target) for ``path``, parsed once."""
        got = self._targets.get((base, path))
        if got is None:
            if len(self._targets) >= 1024:
                self._targets.clear()
            url = self._url(base, path)
            tls = url.scheme == "https"
            port = url.port or (443 if tls else 80)
            got = self._targets[(base, path)] = (url.host, port, tls, url.netloc, url.raw_path)
        return got

    async def call(self, engine: str, method: str, path: str, body: bytes | None) -> tuple[int, bytes]:
        """One whole request to one engine (no retry: the caller chose the engine for a reason)."""
        state = self.cluster.engines[engine]
        self.cluster.begin(engine)
        try:
            r = await self.upstream.http.request(
                method, state.config.url + path, content=body, headers={"content-type": "application/json"}
            )
            return r.status_code, r.content
        except (httpx.HTTPError, TimeoutError) as exc:
            self.metrics.upstream_errors.labels(engine, type(exc).__name__).inc()
            raise UpstreamFailed(
                f"engine '{engine}' failed: {exc!r}",
                isinstance(exc, CONNECT_ERRORS),
                timed_out=isinstance(exc, (httpx.TimeoutException, TimeoutError)),
                refused=_refused(exc),
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
        raise BadRequest("the request body nests JSON too deeply", None, "invalid_json") from None
    except (TypeError, ValueError) as exc:
        raise BadRequest(
            f"the request body cannot be forwarded as JSON: {exc}", None, "invalid_json"
        ) from None


LAG_RETRIES = 3
"""Connects retried on the same engine per request when the event loop's lag timed them out."""


def _timeout_s(exc: BaseException, t: TimeoutsConfig) -> float | None:
    """The limit a connect-phase timeout ran out of; None for a refusal or a reset."""
    if isinstance(exc, httpx.ConnectTimeout):
        return t.connect_s
    if isinstance(exc, TimeoutError):
        return t.first_byte_s
    return None
