"""The retry of a request that has not started goes to a live engine, not to one just killed.

The decision's engine is tried, then one fallback. When that fallback was killed after the
decision (nothing listens any more, not yet ejected), the request used to fail with a 502
``upstream_connect_error`` while a third engine of the pool was alive: a refused or reset
connection is known at once and costs no time, so it must not use up the one retry. Here
"killed" engines are ports held by a bound socket that does not listen (ECONNREFUSED, the port
cannot be taken meanwhile) and the live engine is a minimal aiohttp stand-in in this process.
Asserted on which engine answered and the ``agentgw_upstream_errors_total`` counters."""

from __future__ import annotations

import socket
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager, contextmanager

import httpx
import pytest
from aiohttp import web

from gateway.config import load_config
from gateway.core.types import Decision
from gateway.errors import UpstreamFailed
from gateway.service.cluster import Cluster
from gateway.service.forwarding import Forwarder
from gateway.service.metrics import GatewayMetrics
from gateway.service.proxy import make_upstream


@contextmanager
def _dead_port() -> Iterator[int]:
    """A port where nothing listens (connects are refused) and that nobody else can take."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        yield int(s.getsockname()[1])


@asynccontextmanager
async def _live_engine() -> AsyncIterator[tuple[int, list[int]]]:
    """A stand-in engine answering every POST with 200; yields its port and a hit counter."""
    hits: list[int] = []

    async def handle(request: web.Request) -> web.Response:
        await request.read()
        hits.append(1)
        return web.json_response({"ok": True})

    app = web.Application()
    app.router.add_post("/v1/chat/completions", handle)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = runner.addresses[0][1]
    try:
        yield int(port), hits
    finally:
        await runner.cleanup()


def _forwarder(ports: dict[str, int]) -> tuple[Forwarder, GatewayMetrics]:
    engines = [{"name": n, "url": f"http://127.0.0.1:{p}", "model": "m"} for n, p in ports.items()]
    config = load_config(None, pools=[{"name": "p", "role": "any", "engines": engines}])
    probe = httpx.AsyncClient(transport=httpx.MockTransport(lambda r: httpx.Response(200)))
    metrics = GatewayMetrics()
    return Forwarder(config, make_upstream(config), Cluster(config, probe), metrics), metrics


def _errors(metrics: GatewayMetrics, engine: str, kind: str = "connect") -> float:
    value = metrics.registry.get_sample_value(
        "agentgw_upstream_errors_total", {"engine": engine, "kind": kind}
    )
    return value or 0.0


def _decision(engine: str, *fallbacks: str) -> Decision:
    return Decision(
        engine=engine,
        pool="p",
        reason="test",
        profile="test",
        cached_tokens=0,
        uncached_tokens=10,
        fallbacks=fallbacks,
    )


async def test_a_retry_that_finds_its_fallback_killed_goes_on_to_a_live_engine() -> None:
    with _dead_port() as a, _dead_port() as b:
        async with _live_engine() as (c, hits):
            fwd, metrics = _forwarder({"a": a, "b": b, "c": c})
            try:
                # a and b were killed after the decision: both still healthy in the cluster
                assert fwd.cluster.routable("a") and fwd.cluster.routable("b")
                relay = await fwd.open(_decision("a", "b", "c"), "/v1/chat/completions", b"{}", [])
                assert relay.engine == "c" and relay.retried and relay.status == 200
                await relay.read()
                await relay.aclose()
                relay.finished()
                assert hits == [1]
                assert _errors(metrics, "a") == 1 and _errors(metrics, "b") == 1
                assert _errors(metrics, "c") == 0
                # the refusals ejected both, marked as refused (left out even by a panic)
                assert not fwd.cluster.engines["a"].healthy and fwd.cluster.engines["a"].refused
                assert not fwd.cluster.engines["b"].healthy and fwd.cluster.engines["b"].refused
                assert fwd.cluster.engines["a"].inflight == fwd.cluster.engines["b"].inflight == 0
            finally:
                await fwd.upstream.aclose()


async def test_when_every_engine_refuses_each_is_tried_once_then_502() -> None:
    with _dead_port() as a, _dead_port() as b, _dead_port() as c:
        fwd, metrics = _forwarder({"a": a, "b": b, "c": c})
        try:
            with pytest.raises(UpstreamFailed) as failed:
                await fwd.open(_decision("a", "b", "c"), "/v1/chat/completions", b"{}", [])
            assert failed.value.connect
            assert [_errors(metrics, n) for n in "abc"] == [1, 1, 1]
            assert all(s.inflight == 0 for s in fwd.cluster.engines.values())
        finally:
            await fwd.upstream.aclose()
