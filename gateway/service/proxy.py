"""The upstream side of the proxy: one pooled ``httpx.AsyncClient`` per app, aiohttp underneath.

httpx's own connection pool is the main cost of a Python proxy under concurrency
(encode/httpx#3215; ANCHORS.md): the client keeps httpx's API but runs on aiohttp's transport
(``httpx-aiohttp``), keep-alive pooled, TCP_NODELAY on. Tests inject ``httpx.MockTransport`` or
``httpx.ASGITransport`` through ``transport``.
"""

from __future__ import annotations

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


def make_client(
    config: GatewayConfig, transport: httpx.AsyncBaseTransport | None = None
) -> httpx.AsyncClient:
    t = config.timeouts
    limits = httpx.Limits(
        max_connections=config.limits.max_connections_per_engine * max(1, _num_engines(config)),
        max_keepalive_connections=config.limits.max_connections_per_engine,
        keepalive_expiry=60.0,
    )
    timeout = httpx.Timeout(connect=t.connect_s, read=t.read_s, write=t.read_s, pool=t.connect_s)
    if transport is None:
        transport = AiohttpTransport(limits=limits)
    return httpx.AsyncClient(transport=transport, timeout=timeout, limits=limits)


def _num_engines(config: GatewayConfig) -> int:
    return sum(len(p.engines) for p in config.pools)


#: Connection-level failures before any byte of a response: safe to retry elsewhere.
CONNECT_ERRORS = (httpx.ConnectError, httpx.ConnectTimeout, httpx.PoolTimeout)
