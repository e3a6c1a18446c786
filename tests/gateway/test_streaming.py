"""The relay never buffers: each upstream SSE chunk reaches the client when the engine sends it.

An engine's own pacing varies with machine load (vLLM coalesces deltas when its API server falls
behind), so this uses the stand-in engine with a fixed inter-token delay behind a real gateway.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator

import httpx
import orjson
import pytest

from tests.conftest import ServedGateway, fake_engine, wait_ready

CHUNKS, ITL_MS = 16, 60


@pytest.fixture(scope="module")
def paced_engine() -> Iterator[str]:
    with fake_engine("--model", "m", "--tokens", str(CHUNKS), "--itl-ms", str(ITL_MS)) as url:
        yield url


def test_each_chunk_is_relayed_as_the_engine_sends_it(paced_engine: str) -> None:
    cfg = {
        "pools": [{"name": "p", "role": "any", "engines": [{"name": "e", "url": paced_engine, "model": "m"}]}]
    }
    with ServedGateway(cfg) as gw:
        wait_ready(gw.url)
        body = {"model": "m", "messages": [{"role": "user", "content": "go"}], "stream": True}
        arrivals = []
        t0 = time.perf_counter()
        with httpx.stream("POST", gw.url + "/v1/chat/completions", json=body, timeout=30) as r:
            for line in r.iter_lines():
                if line.startswith("data:"):
                    arrivals.append(time.perf_counter() - t0)
    assert len(arrivals) >= CHUNKS
    # the engine spaces its chunks 60 ms apart: so must their arrivals be, end to end
    span = arrivals[CHUNKS - 1] - arrivals[0]
    assert span >= 0.8 * (CHUNKS - 1) * ITL_MS / 1000, arrivals
    assert arrivals[0] < span / 2, arrivals


def test_a_stray_receive_message_does_not_hide_a_later_disconnect(paced_engine: str) -> None:
    """A server may wake a pending ``receive()`` with an empty ``http.request``; the relay must keep
    watching and still stop when the client goes away (the ASGI app driven directly, on the served
    gateway's own loop, so the messages are exactly these)."""
    cfg = {
        "pools": [{"name": "p", "role": "any", "engines": [{"name": "e", "url": paced_engine, "model": "m"}]}]
    }
    with ServedGateway(cfg) as gw:
        wait_ready(gw.url)
        body = orjson.dumps({"model": "m", "messages": [{"role": "user", "content": "go"}], "stream": True})
        scope = {
            "type": "http",
            "method": "POST",
            "path": "/v1/chat/completions",
            "headers": [(b"content-type", b"application/json")],
        }

        async def drive() -> list[dict]:
            inbox: asyncio.Queue[dict] = asyncio.Queue()
            inbox.put_nowait({"type": "http.request", "body": body, "more_body": False})
            inbox.put_nowait({"type": "http.request", "body": b"", "more_body": False})  # the stray one
            sent: list[dict] = []

            async def send(message: dict) -> None:
                sent.append(message)
                if sum(1 for m in sent if m.get("body")) == 3:
                    inbox.put_nowait({"type": "http.disconnect"})  # the client leaves after 3 chunks

            await asyncio.wait_for(gw.app(scope, inbox.get, send), 20)
            return sent

        assert gw.loop is not None
        sent = asyncio.run_coroutine_threadsafe(drive(), gw.loop).result(30)
        chunks = [m for m in sent if m.get("body")]
        # the engine had CHUNKS more to send, 60 ms apart: the relay stopped at the disconnect
        assert 3 <= len(chunks) <= 5, len(chunks)
        metrics = httpx.get(gw.url + "/metrics").text
        assert 'agentgw_client_disconnects_total{engine="e"} 1.0' in metrics
        assert 'status="499"' in metrics
        # ... and closed its upstream connection mid-stream, which is what makes vLLM abort
        deadline = time.monotonic() + 5
        while streams_cut(paced_engine) < 1 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert streams_cut(paced_engine) == 1


def streams_cut(engine: str) -> float:
    for line in httpx.get(engine + "/metrics").text.splitlines():
        if line.startswith("fake_engine_streams_cut_total"):
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError("the stand-in engine reports no fake_engine_streams_cut_total")
