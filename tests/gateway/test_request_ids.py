"""Request ids: the client's ``x-request-id`` (or one made by the gateway) comes back on every
response, goes to the engine (tests/benchmarks/test_balancer.py checks vLLM names its completion
after it) and is in the log lines written while the request runs."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import re

import httpx
import pytest

from gateway.service.request_ids import REQUEST_ID, RequestIdFilter, install_log_filter, take_request_id
from tests.conftest import ServedGateway, fake_engine, wait_ready


def _chat(url: str, headers: dict[str, str] | None = None) -> httpx.Response:
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    return httpx.post(url + "/v1/chat/completions", json=body, headers=headers or {}, timeout=30)


def test_the_id_is_the_clients_or_made_and_comes_back_on_every_response(
    caplog: pytest.LogCaptureFixture,
) -> None:
    # "gone" answers its first probe (an engine never seen up is not routable), then dies
    # before the requests that find it
    with contextlib.ExitStack() as gone_engine, fake_engine("--model", "m") as a:
        dead = gone_engine.enter_context(fake_engine("--model", "m"))
        cfg = {
            "pools": [
                {
                    "name": "p",
                    "engines": [
                        {"name": "e0", "url": a, "model": "m"},
                        {"name": "gone", "url": dead, "model": "m"},
                    ],
                }
            ],
            "routing": {"profile": "round_robin"},
            "limits": {"eject_after_failures": 100},  # probes leave "gone" in, so a request finds it
            "timeouts": {"health_interval_s": 30},
        }
        install_log_filter([caplog.handler])
        caplog.set_level(logging.WARNING, logger="agentgw")
        with ServedGateway(cfg) as gw:
            wait_ready(gw.url)
            r = _chat(gw.url, {"x-request-id": "client-id-1"})
            assert r.status_code == 200 and r.headers["x-request-id"] == "client-id-1"
            made = _chat(gw.url).headers["x-request-id"]
            assert re.fullmatch(r"[0-9a-f]{32}", made)
            # an id that is too long or carries other bytes is replaced, not refused
            r = _chat(gw.url, {"x-request-id": "x" * 200})
            assert r.status_code == 200 and re.fullmatch(r"[0-9a-f]{32}", r.headers["x-request-id"])
            r = _chat(gw.url, {"x-request-id": "a b"})
            assert re.fullmatch(r"[0-9a-f]{32}", r.headers["x-request-id"])
            # errors and the admin routes carry it too
            bad = httpx.post(gw.url + "/v1/chat/completions", content=b"{", headers={"x-request-id": "bad-1"})
            assert bad.status_code == 400 and bad.headers["x-request-id"] == "bad-1"
            assert (
                httpx.get(gw.url + "/health", headers={"x-request-id": "h-1"}).headers["x-request-id"]
                == "h-1"
            )
            gone_engine.close()
            # a log line written while a request runs names it: the first request sent to the
            # dead engine ejected it (and was retried on e0)
            ids = {f"retry-{i}" for i in range(4)} | {"client-id-1"}
            for i in range(4):
                assert _chat(gw.url, {"x-request-id": f"retry-{i}"}).status_code == 200
            ejected = [rec for rec in caplog.records if "gone" in rec.getMessage()]
            assert ejected, [rec.getMessage() for rec in caplog.records]
            assert {getattr(rec, "request_id", None) for rec in ejected} <= ids | {made}


def test_take_request_id_and_the_filter() -> None:
    assert take_request_id([(b"x-request-id", b"abc-1:2/3")]) == (b"abc-1:2/3", True)
    rid, own = take_request_id([(b"x-request-id", b"")])
    assert not own and len(rid) == 32
    assert not take_request_id([(b"x-request-id", "é".encode())])[1]

    async def one(rid: str) -> str:
        token = REQUEST_ID.set(rid)
        try:
            await asyncio.sleep(0)
            rec = logging.LogRecord("agentgw", logging.INFO, __file__, 1, "m", None, None)
            RequestIdFilter().filter(rec)
            return str(rec.request_id)  # type: ignore[attr-defined]
        finally:
            REQUEST_ID.reset(token)

    async def both() -> list[str]:
        return list(await asyncio.gather(one("a"), one("b")))

    assert asyncio.run(both()) == ["a", "b"]  # concurrent requests keep their own ids
    rec = logging.LogRecord("agentgw", logging.INFO, __file__, 1, "m", None, None)
    RequestIdFilter().filter(rec)
    assert rec.request_id == "-"  # type: ignore[attr-defined]
