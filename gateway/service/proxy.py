"""The upstream side of the proxy: one HTTP client API (httpx's) over one pool of keep-alive
connections to the engines.

Everything the gateway sends to an engine goes through an ``httpx.AsyncBaseTransport``:

- ``Upstream.transport``: :class:`~gateway.service.http1.Http1Transport` (asyncio protocols and
  httptools' parser, keep-alive pooled per engine, TCP_NODELAY on); with
  ``AGENTGW_UPSTREAM_CLIENT=aiohttp``, :class:`EngineTransport` (the same interface over an
  ``aiohttp.ClientSession``, for comparisons); or whatever a test injects
  (``httpx.MockTransport``: the hot path then runs without sockets). The hot relay calls it
  directly (:meth:`Upstream.send`): httpx's client layer (redirects, cookies, auth, hooks) is not
  needed there, and httpx's own connection pool is the main cost of a Python proxy under
  concurrency (encode/httpx#3215, ANCHORS.md).
- ``Upstream.http``: an ``httpx.AsyncClient`` on the same transport for the control plane:
  health probes, metrics scrapes, engine_ext's control API, whole one-off requests.

Both transports' failures come out as httpx's, keeping what the retry logic needs to know: a refused
connection is :class:`ConnectionRefused` (an ``httpx.ConnectError``), a connect timeout
``httpx.ConnectTimeout``, a connection reset or closed before or during the response
``httpx.ReadError``, a read that fell silent past its limit ``httpx.ReadTimeout``. This module
is the only one in the gateway that imports aiohttp.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass

import aiohttp
import httpx

from gateway.config import GatewayConfig
from gateway.service.http1 import ConnectionRefused, Http1Transport

__all__ = [
    "CLIENT_ENV",
    "CONNECT_ERRORS",
    "HOP_HEADERS",
    "RESPONSE_DROP",
    "ConnectionRefused",
    "EngineTransport",
    "Upstream",
    "make_upstream",
]

CLIENT_ENV = "AGENTGW_UPSTREAM_CLIENT"
"""``aiohttp`` selects :class:`EngineTransport` (aiohttp's client) instead of the default
:class:`~gateway.service.http1.Http1Transport`, for comparisons (``benchmarks.overhead``)."""

#: Hop-by-hop and length headers never forwarded in either direction.
HOP_HEADERS = frozenset(
    {
        b"connection",
        b"keep-alive",
        b"proxy-connection",
        b"transfer-encoding",
        b"te",
        b"trailer",
        b"upgrade",
        b"content-length",
        b"host",
        b"accept-encoding",
    }
)

#: Upstream response headers not relayed (the gateway's server sets its own).
RESPONSE_DROP = HOP_HEADERS | {b"date", b"server"}


#: Failures before any byte of a response: safe to retry on another engine. A connection reset
#: before the response headers is one (a killed engine; ``httpx.ReadError``).
CONNECT_ERRORS: tuple[type[BaseException], ...] = (
    httpx.ConnectError,
    httpx.ConnectTimeout,
    httpx.PoolTimeout,
    httpx.ReadError,
    httpx.RemoteProtocolError,
    TimeoutError,
)


@contextlib.contextmanager
def _as_httpx(request: httpx.Request) -> Iterator[None]:
    """aiohttp's failures as httpx's (see the module docstring)."""
    try:
        yield
    except aiohttp.ClientConnectorError as exc:
        kind = ConnectionRefused if isinstance(exc.os_error, ConnectionRefusedError) else httpx.ConnectError
        raise kind(str(exc), request=request) from exc
    except aiohttp.ConnectionTimeoutError as exc:
        raise httpx.ConnectTimeout(str(exc) or "connect timed out", request=request) from exc
    except aiohttp.ServerTimeoutError as exc:
        raise httpx.ReadTimeout(str(exc) or "read timed out", request=request) from exc
    except (aiohttp.ServerDisconnectedError, aiohttp.ClientOSError, aiohttp.ClientPayloadError) as exc:
        raise httpx.ReadError(str(exc) or type(exc).__name__, request=request) from exc
    except aiohttp.ClientError as exc:
        raise httpx.RemoteProtocolError(str(exc) or type(exc).__name__, request=request) from exc


class _Body(httpx.AsyncByteStream):
    """An aiohttp response body, chunk by chunk as it arrives."""

    __slots__ = ("_request", "_response")

    def __init__(self, response: aiohttp.ClientResponse, request: httpx.Request) -> None:
        self._response = response
        self._request = request

    async def __aiter__(self) -> AsyncIterator[bytes]:
        with _as_httpx(self._request):
            async for chunk in self._response.content.iter_any():
                yield chunk

    async def aclose(self) -> None:
        """A body read to its end returns the connection to the pool; one closed mid-response
        drops it (the engine sees the client leave: vLLM aborts the request)."""
        if self._response.content.at_eof():
            self._response.release()
        else:
            self._response.close()


class EngineTransport(httpx.AsyncBaseTransport):
    """httpx's transport interface over one ``aiohttp.ClientSession``. Per-request timeouts come
    from httpx's ``timeout`` extension: ``connect`` (the socket), ``read`` (between chunks)."""

    def __init__(self, session: aiohttp.ClientSession) -> None:
        self.session = session

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        timeout = request.extensions.get("timeout", {})
        body = request.content or None
        with _as_httpx(request):
            response = await self.session.request(
                request.method,
                str(request.url),
                data=body,
                headers=[(k.decode("latin-1"), v.decode("latin-1")) for k, v in request.headers.raw],
                allow_redirects=False,
                timeout=aiohttp.ClientTimeout(
                    sock_connect=timeout.get("connect"), sock_read=timeout.get("read")
                ),
            )
        return httpx.Response(
            response.status,
            headers=response.raw_headers,
            stream=_Body(response, request),
            request=request,
        )

    async def aclose(self) -> None:
        await self.session.close()


@dataclass(slots=True)
class Upstream:
    transport: httpx.AsyncBaseTransport
    http: httpx.AsyncClient
    timeout: httpx.Timeout
    """A non-streamed request's limits (a streamed one reads with ``inter_chunk_s``)."""
    fast: Http1Transport | None = None
    """The transport when it is :class:`~gateway.service.http1.Http1Transport`: the relay then
    sends through :meth:`~gateway.service.http1.Http1Transport.send_raw`, without httpx's
    request and response objects."""

    async def send(self, request: httpx.Request) -> httpx.Response:
        """``request`` through the transport, its response's body not read yet."""
        return await self.transport.handle_async_request(request)

    async def aclose(self) -> None:
        await self.http.aclose()
        await self.transport.aclose()


def make_upstream(config: GatewayConfig, transport: httpx.AsyncBaseTransport | None = None) -> Upstream:
    """``transport`` replaces the engines' transport, data and control plane alike (tests inject
    ``httpx.MockTransport``)."""
    t = config.timeouts
    if transport is None:
        per_engine = config.limits.max_connections_per_engine
        if os.environ.get(CLIENT_ENV, "http1") == "aiohttp":
            n_engines = max(1, sum(len(p.engines) for p in config.pools))
            connector = aiohttp.TCPConnector(
                limit=per_engine * n_engines,
                limit_per_host=per_engine,
                keepalive_timeout=60,
                ttl_dns_cache=300,
            )
            session = aiohttp.ClientSession(
                connector=connector, auto_decompress=False, skip_auto_headers=("User-Agent",)
            )
            transport = EngineTransport(session)
        else:
            transport = Http1Transport(limit_per_host=per_engine, keepalive_s=60.0)
    timeout = httpx.Timeout(connect=t.connect_s, read=t.read_s, write=t.read_s, pool=t.connect_s)
    http = httpx.AsyncClient(transport=transport, timeout=timeout)
    return Upstream(transport, http, timeout, transport if isinstance(transport, Http1Transport) else None)
