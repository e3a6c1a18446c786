"""Redis outage: with a real redis-server stopped the session store serves from its local view
(degraded, counted), the gateway answers hinted requests, the session API and /ready without a
500, and everything written meanwhile is pushed back when Redis returns. Plus the bounded
WATCH/MULTI retry loop (it used to spin forever under conflicts)."""

from __future__ import annotations

import asyncio
import shutil
import socket
import subprocess
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
import redis

from gateway.api.errors import to_api_error
from gateway.core.sessions import SessionRecord
from gateway.local.engines import free_ports
from gateway.service.metrics import GatewayMetrics
from gateway.service.session_store import RedisSessionStore, SessionStoreBusy
from tests.conftest import ServedGateway, fake_engine, wait_ready

pytestmark = pytest.mark.redis


class RedisProcess:
    """A redis-server we may stop and start again on the same port (no persistence)."""

    def __init__(self) -> None:
        exe = shutil.which("redis-server")
        if exe is None:
            pytest.fail("redis-server is not installed (./scripts/setup.sh --test installs it)")
        self.exe = exe
        self.port = free_ports(1)[0]
        self.url = f"redis://127.0.0.1:{self.port}/0"
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        self.proc = subprocess.Popen(
            [self.exe, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.STDOUT,
        )
        for _ in range(200):
            with socket.socket() as s:
                if s.connect_ex(("127.0.0.1", self.port)) == 0:
                    return
            time.sleep(0.05)
        raise RuntimeError("redis-server did not start")

    def stop(self) -> None:
        if self.proc is not None:
            self.proc.terminate()
            self.proc.wait(timeout=10)
            self.proc = None

    def client(self) -> redis.Redis:
        return redis.Redis.from_url(self.url)


@pytest.fixture
def rp() -> Iterator[RedisProcess]:
    r = RedisProcess()
    r.start()
    try:
        yield r
    finally:
        r.stop()


class Clock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


def rec(sid: str, t: float, turns: int = 0) -> SessionRecord:
    r = SessionRecord(sid, created=t, last_activity=t, home="e0", pool="p")
    r.turns = turns
    return r


def stored(rp: RedisProcess, sid: str) -> dict[str, Any] | None:
    import orjson

    raw = rp.client().get(f"agentgw:s:{sid}")
    return None if raw is None else orjson.loads(raw)


async def test_resync_keeps_what_is_left_of_the_ttl(rp: RedisProcess) -> None:
    """A session written during the outage gets the rest of its TTL back in Redis, not a new
    one (the soak found sessions idle past the TTL still stored after a Redis bounce)."""
    clock = Clock()
    store = RedisSessionStore(rp.url, 100, 10.0, clock=clock, retry_s=1.0)
    try:
        rp.stop()
        await store.put(rec("fresh", 0.0))
        await store.put(rec("old", -9.5))
        assert store.degraded
        rp.start()
        clock.t = 7.0  # "fresh" has 3 s left, "old" expired at 0.5
        assert not await store.probe()
        ttl_ms = rp.client().pttl("agentgw:s:fresh")
        assert 0 < ttl_ms <= 3000
        assert stored(rp, "old") is None
    finally:
        await store.close()


async def test_store_serves_locally_while_redis_is_down_and_resyncs(rp: RedisProcess) -> None:
    clock, metrics = Clock(), GatewayMetrics()
    store = RedisSessionStore(rp.url, 100, 3600, clock=clock, metrics=metrics, retry_s=5.0)
    try:
        await store.put(rec("a", 1.0))
        await store.put(rec("gone", 1.0))
        assert not store.degraded and (await store.get("a", 1.0)) is not None

        rp.stop()
        a = await store.get("a", 2.0)  # from the local view
        assert a is not None and a.home == "e0" and store.degraded and store.fallbacks == 1

        def bump(r: SessionRecord | None) -> SessionRecord:
            assert r is not None
            r.turns += 1
            r.last_activity = 3.0
            return r

        assert (await store.update("a", 3.0, bump)).turns == 1  # type: ignore[union-attr]
        await store.put(rec("b", 3.0))
        assert (await store.delete("gone")) is not None
        assert await store.probe()  # still degraded (and not retried before retry_s)
        assert store.fallbacks == 4
        text = metrics.render().decode()
        assert "agentgw_session_store_degraded 1.0" in text
        assert 'agentgw_session_store_fallbacks_total{op="update"} 2.0' in text

        rp.start()  # an empty Redis (no persistence): everything must come from the local view
        assert await store.probe()  # before retry_s: the local view still serves
        clock.t += 5.0
        assert not await store.probe()
        assert store.resyncs == 1 and not store.degraded
        assert stored(rp, "a")["turns"] == 1  # type: ignore[index]
        assert stored(rp, "b") is not None and stored(rp, "gone") is None
        assert (await store.get("b", 4.0)) is not None and store.fallbacks == 4
        assert "agentgw_session_store_degraded 0.0" in metrics.render().decode()
    finally:
        await store.close()


async def test_resync_keeps_what_another_replica_wrote_later(rp: RedisProcess) -> None:
    clock = Clock()
    mine = RedisSessionStore(rp.url, 100, 3600, clock=clock, retry_s=1.0)
    try:
        await mine.put(rec("s", 1.0))
        rp.stop()
        await mine.put(rec("s", 2.0, turns=1))  # local, during the outage
        assert mine.degraded
        rp.start()
        other = RedisSessionStore(rp.url, 100, 3600)
        await other.put(rec("s", 9.0, turns=7))  # another replica, after Redis came back
        await other.close()
        clock.t += 1.0
        assert not await mine.probe()
        assert stored(rp, "s")["turns"] == 7  # type: ignore[index]
        got = await mine.get("s", 9.0)
        assert got is not None and got.turns == 7
    finally:
        await mine.close()


async def test_watch_retry_loop_is_bounded(redis_url: str) -> None:
    store = RedisSessionStore(redis_url, 100, 3600, prefix="bounded:", max_conflicts=3)
    sync = redis.Redis.from_url(redis_url)
    calls = 0

    def conflicting(r: SessionRecord | None) -> SessionRecord:
        nonlocal calls
        calls += 1
        sync.set("bounded:s:s", b'{"session_id": "s"}')  # another writer, every time
        return rec("s", 1.0)

    try:
        with pytest.raises(SessionStoreBusy) as e:
            await store.update("s", 1.0, conflicting)
        assert (to_api_error(e.value).status, e.value.code, e.value.retry_after) == (503, "session_busy", 1)
        assert calls == 3 and not store.degraded
        assert (await store.update("s", 1.0, lambda _r: rec("s", 2.0, turns=2))).turns == 2  # type: ignore[union-attr]
    finally:
        await store.close()
        sync.close()


def test_gateway_keeps_routing_with_redis_stopped(rp: RedisProcess) -> None:
    with fake_engine("--model", "m") as engine:
        cfg = {
            "pools": [
                {"name": "any", "role": "any", "engines": [{"name": "e0", "url": engine, "model": "m"}]}
            ],
            "sessions": {"backend": "redis", "redis_url": rp.url, "redis_retry_s": 0.2},
        }
        with ServedGateway(cfg) as gw:
            wait_ready(gw.url)
            with httpx.Client(base_url=gw.url, timeout=30) as c:

                def chat(sid: str) -> httpx.Response:
                    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
                    return c.post("/v1/chat/completions", json=body, headers={"x-session-id": sid})

                ok = chat("s1")
                assert ok.status_code == 200 and "x-agentgw-session-store" not in ok.headers
                assert c.get("/ready").json()["degraded"] is False
                rp.stop()
                r = chat("s1")
                assert r.status_code == 200, r.text
                assert r.headers["x-agentgw-session-store"] == "local"  # placed on the local view
                assert chat("s2").status_code == 200
                ready = c.get("/ready")
                assert ready.status_code == 200 and ready.json()["degraded"] is True
                assert "agentgw_session_store_degraded 1.0" in c.get("/metrics").text
                s = c.get("/v1/agent/sessions/s1")
                assert s.status_code == 200 and s.json()["turns"] >= 2, s.text
                h = c.post("/v1/agent/sessions/s2/hints", json={"expected_tool_latency_ms": 5000})
                assert h.status_code == 200, h.text
                assert c.delete("/v1/agent/sessions/s2").status_code == 200

                rp.start()
                for _ in range(100):  # bounded: /ready retries Redis every redis_retry_s
                    if c.get("/ready").json()["degraded"] is False:
                        break
                    time.sleep(0.1)
                assert c.get("/ready").json()["degraded"] is False
                assert "agentgw_session_store_degraded 0.0" in c.get("/metrics").text
                assert stored(rp, "s1") is not None and stored(rp, "s2") is None
                assert chat("s1").status_code == 200


async def test_redis_restarted_empty_gets_the_local_views_back(rp: RedisProcess) -> None:
    """Redis restarts without persistence: each replica finds the epoch marker gone (on its next
    miss, or when it recovers from the outage its first call ran into) and pushes its live records
    back, so a session keeps the home a replica knew; a record deleted before stays deleted."""
    clock, metrics = Clock(), GatewayMetrics()
    a = RedisSessionStore(rp.url, 100, 3600, clock=clock, metrics=metrics, retry_s=1.0)
    b = RedisSessionStore(rp.url, 100, 3600, clock=clock, retry_s=1.0)

    async def settle(store: RedisSessionStore) -> None:
        if store.degraded:  # its pooled connection died with the old Redis
            clock.t += 1.0
            assert not await store.probe()

    try:
        await a.put(rec("s1", 0.0, turns=3))
        await b.put(rec("s2", 0.0, turns=5))
        await a.put(rec("gone", 0.0))
        assert (await a.delete("gone")) is not None
        assert stored(rp, "s1") is not None
        rp.stop()
        rp.start()  # empty
        assert stored(rp, "s1") is None
        await b.get("s1", clock.t)  # b never held s1: a miss (or an outage), and the marker is gone
        await settle(b)
        assert b.reseeds == 1
        assert stored(rp, "s2")["turns"] == 5  # type: ignore[index]  # b pushed its own view
        got = await a.get("s1", clock.t)  # a finds b's new marker (or recovers): it pushes its view
        await settle(a)
        assert got is not None and got.turns == 3 and got.home == "e0"
        assert a.reseeds == 1 and not a.degraded
        assert stored(rp, "s1")["turns"] == 3  # type: ignore[index]
        got = await b.get("s1", clock.t)
        assert got is not None and got.home == "e0"  # now every replica reads it
        assert stored(rp, "gone") is None
        assert "agentgw_session_store_resyncs_total 1.0" in metrics.render().decode()
        # a new session's first write after a loss pushes the view back too
        rp.stop()
        rp.start()
        await a.put(rec("new", clock.t))
        await settle(a)
        assert a.reseeds == 2 and stored(rp, "s1") is not None and stored(rp, "new") is not None
    finally:
        await a.close()
        await b.close()


async def test_a_replica_pushes_its_view_back_when_another_finds_redis_empty(rp: RedisProcess) -> None:
    """The epoch watch: replica b writes nothing after the restart, but a's miss writes a new
    marker, and b (watching every retry_s) pushes back the sessions only it holds."""
    a = RedisSessionStore(rp.url, 100, 3600, retry_s=0.1)
    b = RedisSessionStore(rp.url, 100, 3600, retry_s=0.1)
    try:
        now = time.time()
        await b.put(rec("only_b", now, turns=4))
        await a.put(rec("only_a", now))
        b.start()
        rp.stop()
        rp.start()
        got = None
        for _ in range(3):  # a's first call may find its pooled connection dead (degraded)
            got = await a.get("only_b", now)
            if not a.degraded:
                break
            await asyncio.sleep(0.2)
        # a found the loss, wrote a new marker and, missing only_b so soon after a loss, waited
        # one watch period: b had pushed it back by then, so the turn keeps its home
        assert got is not None and got.home == "e0" and got.turns == 4
        assert stored(rp, "only_b")["turns"] == 4  # type: ignore[index]
        assert b.reseeds == 1 and a.reseeds == 1
    finally:
        await a.close()
        await b.close()


async def test_calls_during_the_push_back_wait_for_it_instead_of_the_local_view(rp: RedisProcess) -> None:
    """Redis answers again and the store is pushing its view back: a call arriving meanwhile
    waits for the push and reads Redis, which holds a session another replica served (the local
    view does not: answered from it, the turn would have routed as a new session's)."""
    clock = Clock()
    a = RedisSessionStore(rp.url, 100, 3600, clock=clock, retry_s=1.0)
    b = RedisSessionStore(rp.url, 100, 3600)
    try:
        for i in range(200):  # a local view that takes a while to push back
            await a.put(rec(f"mine{i}", 0.0))
        rp.stop()
        await a.put(rec("mine0", 1.0, turns=1))
        assert a.degraded
        rp.start()
        await b.put(rec("theirs", 1.0, turns=6))  # another replica, once Redis is back
        clock.t += 1.0
        push = asyncio.create_task(a.probe())
        while not a._pushing:  # Redis answered the recovery's ping: the push runs
            assert not push.done()
            await asyncio.sleep(0)
        got = await a.get("theirs", clock.t)
        assert not await push
        assert got is not None and got.turns == 6 and a.fallbacks == 1  # only the put above
        assert stored(rp, "mine0")["turns"] == 1  # type: ignore[index]
    finally:
        await a.close()
        await b.close()


async def test_a_store_started_while_redis_was_down_waits_for_the_others_views(rp: RedisProcess) -> None:
    """A replica (re)started while Redis was down has no marker to compare: when Redis answers
    again, empty, its misses still wait for the replicas that held the sessions to push them
    back (they notice the loss at their next epoch watch), instead of answering new session."""
    clock = Clock()
    b = RedisSessionStore(rp.url, 100, 3600, retry_s=0.1)
    a = None
    try:
        await b.put(rec("only_b", time.time(), turns=4))
        rp.stop()
        a = RedisSessionStore(rp.url, 100, 3600, clock=clock, retry_s=1.0)
        assert await a.get("only_b", 0.0) is None and a.degraded  # Redis down, nothing local
        rp.start()  # empty
        clock.t += 1.0
        assert not await a.probe()  # recovered: the marker was missing, a wrote a new one
        b.start()  # b notices the new marker within its watch period and pushes only_b back
        got = await a.get("only_b", clock.t)
        assert got is not None and got.turns == 4
        assert b.reseeds == 1
    finally:
        if a is not None:
            await a.close()
        await b.close()


async def test_hints_a_replica_took_for_a_session_it_missed_do_not_erase_its_home(rp: RedisProcess) -> None:
    """Redis restarted empty; before replica a pushes its view back, replica b takes hints for a
    session only a knew (``POST .../hints`` makes a homeless record, more recent than a's). The
    push keeps a's placed record, with b's hints, and a read that finds only hints so soon after
    the loss waits for the push: the session's next turn keeps its home."""
    a = RedisSessionStore(rp.url, 100, 3600, retry_s=0.2)
    b = RedisSessionStore(rp.url, 100, 3600, retry_s=0.2)
    now = time.time()

    def hint(r: SessionRecord | None) -> SessionRecord:
        r = r or SessionRecord("s", created=now + 1, last_activity=now + 1)
        r.expected_gap_s, r.last_activity = 30.0, now + 1
        return r

    try:
        await a.put(rec("s", now, turns=3))
        assert await b.get("other", now) is None  # b has read the marker
        rp.stop()
        rp.start()  # empty
        for _ in range(20):  # b's first call may find its pooled connection dead (degraded)
            await b.update("s", now + 1, hint)
            if not b.degraded:
                break
            await asyncio.sleep(0.25)
        assert not b.degraded and stored(rp, "s")["home"] is None  # type: ignore[index]  # hints only
        got = await a.get("s", now + 1)  # a finds the loss and pushes its view back
        assert got is not None and (got.home, got.turns, got.expected_gap_s) == ("e0", 3, 30.0)
        assert stored(rp, "s")["home"] == "e0"  # type: ignore[index]
    finally:
        await a.close()
        await b.close()
