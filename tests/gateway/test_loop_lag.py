"""A timeout the gateway's own event-loop lag explains is not held against an engine.

Under a burst of 2,000 streams on a shared core the loop ran seconds late, every upstream connect
timer (2 s) fired before the connection it guarded was looked at, and the cluster ejected both
engines at once, as for a refused connection: 503s to every request. Here the loop is blocked
for real (``time.sleep`` on the loop), then the cluster is told of a timeout."""

from __future__ import annotations

import asyncio
import time

import httpx

from gateway.config import load_config
from gateway.service.cluster import Cluster
from gateway.service.loop_lag import LoopLag

CFG = {
    "pools": [
        {
            "name": "p",
            "role": "any",
            "engines": [
                {"name": "a", "url": "http://a:1", "model": "m"},
                {"name": "b", "url": "http://b:1", "model": "m"},
            ],
        }
    ],
    "limits": {"eject_after_failures": 2},
    "timeouts": {"connect_s": 0.2, "health_timeout_s": 0.2},
}


def _cluster(handler=None) -> Cluster:
    def ok(request: httpx.Request) -> httpx.Response:
        return httpx.Response(200)

    client = httpx.AsyncClient(transport=httpx.MockTransport(handler or ok))
    return Cluster(load_config(None, **CFG), client)


async def _beats(lag: LoopLag, n: int = 3) -> None:
    for _ in range(n):
        await asyncio.sleep(lag.interval_s)


async def test_loop_lag_records_a_blocked_loop() -> None:
    lag = LoopLag(interval_s=0.01, window_s=60)
    lag.start()
    try:
        await _beats(lag)
        time.sleep(0.3)  # the loop is blocked: the next beat runs >= 0.29 s late
        assert lag.late() >= 0.29  # overdue beat, seen before it runs
        await _beats(lag)
        assert lag.late() >= 0.29  # and remembered in the window after it ran
        assert lag.excuses(0.4) and lag.excused == 1
        assert not lag.excuses(10.0)
    finally:
        await lag.stop()


async def test_a_connect_timeout_on_a_lagging_loop_ejects_nothing() -> None:
    cluster = _cluster()
    cluster.start()
    try:
        await _beats(cluster.loop_lag)
        time.sleep(0.3)
        for _ in range(5):  # the burst's timers, all at once
            cluster.record_connect_failure("a", timeout_s=0.2)
        assert cluster.engines["a"].healthy and cluster.engines["a"].failures == 0
        assert cluster.loop_lag.excused == 5
        cluster.record_connect_failure("b")  # a refused connection still ejects at once
        assert not cluster.engines["b"].healthy
    finally:
        await cluster.stop()


async def test_a_connect_timeout_on_a_prompt_loop_counts_towards_ejection() -> None:
    cluster = _cluster()
    cluster.start()
    try:
        await _beats(cluster.loop_lag)
        cluster.record_connect_failure("a", timeout_s=10.0)
        assert cluster.engines["a"].healthy and cluster.engines["a"].failures == 1
        cluster.record_connect_failure("a", timeout_s=10.0)
        assert not cluster.engines["a"].healthy  # eject_after_failures: 2
        assert cluster.loop_lag.excused == 0
    finally:
        await cluster.stop()


async def test_a_probe_timeout_on_a_lagging_loop_is_no_verdict() -> None:
    def slow(request: httpx.Request) -> httpx.Response:
        raise httpx.ReadTimeout("timed out", request=request)

    cluster = _cluster(slow)
    cluster.start()
    try:
        await _beats(cluster.loop_lag)
        time.sleep(0.3)
        for _ in range(3):
            await cluster.probe_once()
        assert cluster.engines["a"].healthy and cluster.engines["a"].failures == 0
    finally:
        await cluster.stop()
    # the same timeouts on a loop that keeps up eject (no loop-lag task: nothing is excused)
    cluster = _cluster(slow)
    for _ in range(2):
        await cluster.probe_once()
    assert not cluster.engines["a"].healthy
