"""Replicas on one Redis share their in-flight ledgers (gateway/service/shared_load.py): requests
held open on one replica count in the other's routing views within a few periods, and leave
them when they end; a replica whose ledger stops coming (dead, or Redis down) stops counting."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

import httpx

from gateway.core.load import EngineCounts, InflightLoad
from gateway.service.shared_load import SharedLoad
from tests.conftest import ServedGateway, fake_engine, wait_ready
from tests.gateway.test_session_store_outage import RedisProcess


def _until(cond: Callable[[], bool], timeout_s: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if cond():
            return True
        time.sleep(0.05)
    return False


def test_held_requests_on_one_replica_count_in_the_others_views() -> None:
    rp = RedisProcess()
    rp.start()
    try:
        with fake_engine("--model", "m", "--hold") as url:
            cfg = {
                "pools": [{"name": "p", "engines": [{"name": "e0", "url": url, "model": "m"}]}],
                "sessions": {"backend": "redis", "redis_url": rp.url, "share_load_s": 0.1},
            }
            with ServedGateway(cfg) as a, ServedGateway(cfg) as b:
                wait_ready(a.url)
                wait_ready(b.url)

                def view(gw: ServedGateway) -> tuple[int, int]:
                    v = next(v for v in gw.service.cluster.views() if v.name == "e0")
                    return v.inflight, v.inflight_tokens

                assert view(b) == (0, 0)
                body = {
                    "model": "m",
                    "messages": [{"role": "user", "content": "hold " * 200}],
                    "stream": True,
                }
                held = [
                    threading.Thread(
                        target=lambda: httpx.post(a.url + "/v1/chat/completions", json=body, timeout=30)
                    )
                    for _ in range(3)
                ]
                for t in held:
                    t.start()
                assert _until(lambda: view(a)[0] == 3)
                # b sent nothing, yet sees a's three requests and their prompt tokens
                assert _until(lambda: view(b)[0] == 3), view(b)
                assert view(b)[1] == view(a)[1] > 0
                assert b.service.shared_load.replicas == 1
                httpx.post(url + "/release", timeout=5)
                for t in held:
                    t.join(30)
                assert _until(lambda: view(b) == (0, 0)), view(b)
    finally:
        rp.stop()


async def test_a_silent_replica_stops_counting() -> None:
    rp = RedisProcess()
    rp.start()
    import redis.asyncio as aioredis

    clock = [1000.0]
    try:
        r1, r2 = aioredis.Redis.from_url(rp.url), aioredis.Redis.from_url(rp.url)
        la, lb = InflightLoad(["e0"]), InflightLoad(["e0"])
        a = SharedLoad(r1, la, 0.1, clock=lambda: clock[0])
        b = SharedLoad(r2, lb, 0.1, clock=lambda: clock[0])
        la.sent("e0", 100, 400)
        await a.refresh()
        await b.refresh()
        assert b.of("e0") == EngineCounts(prefilling=1, backlog_tokens=100, decoding=0, tokens=400)
        assert a.of("e0") is None or a.of("e0") == EngineCounts()  # its own ledger is not counted twice
        clock[0] += 10  # a stops writing: past the expiry, b drops it at its next refresh
        await b.refresh()
        assert b.of("e0") is None
        rp.stop()
        clock[0] += 10  # Redis down: b's refresh fails and what it knew expires
        try:
            await b.refresh()
        except Exception:
            pass
        assert b.of("e0") is None
        await r1.aclose()
        await r2.aclose()
    finally:
        rp.stop()
