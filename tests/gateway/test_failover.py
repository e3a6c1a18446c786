"""Health ejection, retry on another engine, 502 and 503: with engines that really die."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from gateway.local.engines import LocalEngine, free_ports, start_engines, stop_engines
from tests.conftest import MODEL, ServedGateway, engine_specs, fake_engine, wait_ready

pytestmark = pytest.mark.engine

CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}


def dead_url() -> str:
    return f"http://127.0.0.1:{free_ports(1)[0]}"


@contextlib.contextmanager
def died_after_start(cfg: dict, names: set[str]) -> Iterator[ServedGateway]:
    """A gateway whose engines ``names`` were up when it started (a stand-in engine process each,
    which its first probe sees) and then died: they stay admitted until probes say otherwise.
    (An engine that never answered is *starting* and kept out of routing from the first probe.)"""
    with contextlib.ExitStack() as procs:
        for pool in cfg["pools"]:
            for e in pool["engines"]:
                if e["name"] in names:
                    e["url"] = procs.enter_context(fake_engine())
        gw = ServedGateway(cfg).__enter__()
        procs.close()  # they die: nothing listens on their ports any more
    try:
        yield gw
    finally:
        gw.__exit__(None, None, None)


@pytest.fixture(scope="module")
def pair(tiny_llama: Path, workdir: Path) -> Iterator[list[LocalEngine]]:
    engines = start_engines(engine_specs(tiny_llama, ["fa", "fb"], workdir), timeout_s=300)
    try:
        yield engines
    finally:
        stop_engines(engines)


def one_pool(engines: list[tuple[str, str]], **kw: object) -> dict:
    return {
        "pools": [
            {
                "name": "p",
                "role": "any",
                "engines": [{"name": n, "url": u, "model": MODEL} for n, u in engines],
            }
        ],
        "timeouts": {"health_interval_s": 0.3, "metrics_interval_s": 0.5, "health_timeout_s": 0.5},
        **kw,
    }


def test_connection_failure_retries_on_another_engine(pair: list[LocalEngine]) -> None:
    cfg = one_pool([("dead", dead_url()), ("live", pair[0].url)], routing={"profile": "round_robin"})
    cfg["timeouts"]["health_interval_s"] = 60  # the dead engine stays admitted: the proxy must cope
    with died_after_start(cfg, {"dead"}) as gw:
        reasons = set()
        for _ in range(2):
            r = httpx.post(gw.url + "/v1/chat/completions", json=CHAT, timeout=30)
            assert r.status_code == 200
            assert r.headers["x-agentgw-engine"] == "live"
            reasons.add(r.headers["x-agentgw-reason"])
        assert "retry" in reasons
        assert (
            'agentgw_upstream_errors_total{engine="dead",kind="connect"}'
            in httpx.get(gw.url + "/metrics").text
        )


def test_all_engines_unreachable_is_502_then_503(pair: list[LocalEngine]) -> None:
    cfg = one_pool([("d1", dead_url()), ("d2", dead_url())])
    cfg["timeouts"]["health_interval_s"] = 60
    with died_after_start(cfg, {"d1", "d2"}) as gw:
        r = httpx.post(gw.url + "/v1/chat/completions", json=CHAT, timeout=30)
        assert r.status_code == 502
        assert r.json()["error"]["code"] == "upstream_connect_error"
        r = httpx.post(gw.url + "/v1/chat/completions", json=CHAT, timeout=30)
        assert r.status_code == 503
        assert r.headers["retry-after"] == "2"
        assert httpx.get(gw.url + "/ready").status_code == 503


def test_killed_engine_is_ejected_and_traffic_moves(pair: list[LocalEngine]) -> None:
    a, b = pair
    with ServedGateway(one_pool([("a", a.url), ("b", b.url)], routing={"profile": "round_robin"})) as gw:
        wait_ready(gw.url)
        seen = {
            httpx.post(gw.url + "/v1/chat/completions", json=CHAT, timeout=30).headers["x-agentgw-engine"]
            for _ in range(4)
        }
        assert seen == {"a", "b"}
        a.kill()
        # probes every health_interval_s, ejection after eject_after_failures: a bound for a
        # loaded machine, not a speed (the event checked is the ejection)
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and gw.service.cluster.engines["a"].healthy:
            time.sleep(0.1)
        assert not gw.service.cluster.engines["a"].healthy
        for _ in range(4):
            r = httpx.post(gw.url + "/v1/chat/completions", json=CHAT, timeout=30)
            assert r.status_code == 200 and r.headers["x-agentgw-engine"] == "b"
        assert 'agentgw_engine_healthy{engine="a"} 0.0' in httpx.get(gw.url + "/metrics").text
