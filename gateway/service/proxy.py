"""The upstream side of the proxy: one pooled aiohttp connection pool per app, two faces.

- ``Upstream.http``: an ``httpx.AsyncClient`` on aiohttp's transport (``httpx-aiohttp``) for the
  control plane: health probes, metrics scrapes, engine_ext's control API.
- ``Upstream.session``: the same ``aiohttp.ClientSession`` used directly by the hot relay.
  httpx's request/response model layer costs ~125 us per proxied streaming request on top of
  aiohttp (measured here: 204 vs 79 us per request at 16 concurrent streams), and httpx's own
  pool is the main cost of a Python proxy under concurrency (encode/httpx#3215, ANCHORS.md).
Both share one connector: keep-alive pooled, TCP_NODELAY on (aiohttp's default).
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

import aiohttp
import httpx
from httpx_aiohttp import AiohttpTransport

from gateway.config import GatewayConfig

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

#: Failures before any byte of a response: safe to retry on another engine.
CONNECT_ERRORS = (
    aiohttp.ClientConnectorError,
    aiohttp.ServerDisconnectedError,
    aiohttp.ClientOSError,  # the connection reset before the response headers: a killed engine
    # (the soak saw ~100 such 502s in 37K requests with an engine SIGKILLed every 40 s)
    asyncio.TimeoutError,
    httpx.ConnectError,
    httpx.ConnectTimeout,
    httpx.PoolTimeout,
)


@dataclass(slots=True)
class Upstream:
    http: httpx.AsyncClient
    session: aiohttp.ClientSession
    timeout: aiohttp.ClientTimeout

    async def aclose(self) -> None:
        await self.http.aclose()
        await self.session.close()


def make_upstream(config: GatewayConfig, transport: httpx.AsyncBaseTransport | None = None) -> Upstream:
    """``transport`` replaces the control-plane transport (tests inject ``httpx.MockTransport``)."""
    t = config.timeouts
    n_engines = max(1, sum(len(p.engines) for p in config.pools))
    per_engine = config.limits.max_connections_per_engine
    connector = aiohttp.TCPConnector(
        limit=per_engine * n_engines, limit_per_host=per_engine, keepalive_timeout=60, ttl_dns_cache=300
    )
    session = aiohttp.ClientSession(
        connector=connector, auto_decompress=False, skip_auto_headers=("User-Agent",)
    )
    limits = httpx.Limits(max_connections=per_engine * n_engines, max_keepalive_connections=per_engine)
    http = httpx.AsyncClient(
        transport=transport or AiohttpTransport(client=session),
        timeout=httpx.Timeout(connect=t.connect_s, read=t.read_s, write=t.read_s, pool=t.connect_s),
        limits=limits,
    )
    return Upstream(http, session, aiohttp.ClientTimeout(sock_connect=t.connect_s, sock_read=t.read_s))
