"""A Responses chain through a fault (found by ``benchmarks.chaos``): a chain must not end with
``previous_response_not_found`` while the response may still exist.

- Its engine paused (SIGSTOP: failing probes, not refusing connections): a 503
  ``owner_unavailable`` with Retry-After naming the field, for ``previous_response_id`` and for
  ``GET /v1/responses/{id}``, also when a request to it times out before its probes fail;
  after SIGCONT the chain continues on that engine. Once the engine
  is gone (SIGKILL: connections refused, vLLM's store with it), the 400 / 404 not-found answers.
- Redis down and this replica's local view without the owner record: a 503
  ``session_store_unavailable`` (another replica may hold it), not a not-found; an owner the
  local view holds still routes.
"""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from testing.net import free_port, wait_http_ok
from tests.conftest import ServedGateway, wait_ready
from tests.gateway.test_session_store_outage import RedisProcess

ROOT = Path(__file__).resolve().parents[2]


class StandIn:
    def __init__(self) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "testing.fake_engine", "--port", str(self.port), "--model", "m"],
            cwd=ROOT,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        wait_http_ok(self.url + "/health", 60, self.proc)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGCONT)
            self.proc.kill()
        self.proc.wait(10)


@pytest.fixture
def two() -> Iterator[list[StandIn]]:
    engines = [StandIn(), StandIn()]
    try:
        yield engines
    finally:
        for e in engines:
            e.stop()


def config(engines: list[StandIn], **extra: Any) -> dict[str, Any]:
    return {
        "pools": [
            {
                "name": "any",
                "role": "any",
                "engines": [{"name": f"e{i}", "url": e.url, "model": "m"} for i, e in enumerate(engines)],
            }
        ],
        "timeouts": {"health_interval_s": 0.2, "health_timeout_s": 0.5},
        **extra,
    }


def until(what: Callable[[], bool], why: str, timeout_s: float = 30) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if what():
            return
        time.sleep(0.05)
    pytest.fail(f"not within {timeout_s} s: {why}")


def respond(c: httpx.Client, previous: str | None = None) -> httpx.Response:
    body: dict[str, Any] = {"model": "m", "input": "hello", "max_output_tokens": 4}
    if previous is not None:
        body["previous_response_id"] = previous
    return c.post("/v1/responses", json=body)


def test_a_paused_owner_is_a_503_to_retry_and_a_dead_one_is_not_found(two: list[StandIn]) -> None:
    with ServedGateway(config(two)) as gw, httpx.Client(base_url=gw.url, timeout=30) as c:
        wait_ready(gw.url)
        first = respond(c)
        assert first.status_code == 200, first.text
        rid, owner = first.json()["id"], first.headers["x-agentgw-engine"]
        engine = two[int(owner[1:])]
        state = gw.service.cluster.engines[owner]

        engine.proc.send_signal(signal.SIGSTOP)
        until(lambda: not state.healthy, "the paused engine ejected (probes time out)")
        assert not state.refused
        r = respond(c, rid)
        assert r.status_code == 503, r.text
        err = r.json()["error"]
        assert err["code"] == "owner_unavailable" and err["param"] == "previous_response_id", err
        assert f"'{owner}'" in err["message"] and int(r.headers["retry-after"]) >= 1
        g = c.get(f"/v1/responses/{rid}")
        assert g.status_code == 503 and g.json()["error"]["param"] == "response_id", g.text

        engine.proc.send_signal(signal.SIGCONT)
        until(lambda: state.healthy, "the engine readmitted after SIGCONT")
        r = respond(c, rid)
        assert r.status_code == 200, r.text
        assert r.headers["x-agentgw-engine"] == owner and r.headers["x-agentgw-reason"] == "owner"

        engine.proc.kill()
        engine.proc.wait(10)
        until(lambda: state.refused and not state.healthy, "the dead engine ejected as refusing")
        r = respond(c, rid)
        assert r.status_code == 400, r.text
        assert r.json()["error"]["code"] == "previous_response_not_found"
        assert c.get(f"/v1/responses/{rid}").status_code == 404


def test_a_paused_owner_that_times_out_before_its_probes_fail_is_a_503(two: list[StandIn]) -> None:
    # probes far apart: the paused engine is still "healthy" when the chain's next link arrives
    cfg = config(two)
    cfg["timeouts"] = {"health_interval_s": 60, "first_byte_s": 1.0, "read_s": 1.0}
    with ServedGateway(cfg) as gw, httpx.Client(base_url=gw.url, timeout=30) as c:
        wait_ready(gw.url)
        first = respond(c)
        assert first.status_code == 200, first.text
        rid, owner = first.json()["id"], first.headers["x-agentgw-engine"]
        engine = two[int(owner[1:])]
        state = gw.service.cluster.engines[owner]
        engine.proc.send_signal(signal.SIGSTOP)
        try:
            r = respond(c, rid)  # connected (the kernel accepts), no answer within first_byte_s
            assert r.status_code == 503, r.text
            err = r.json()["error"]
            assert err["code"] == "owner_unavailable" and err["param"] == "previous_response_id", err
            assert "not answering in time" in err["message"] and int(r.headers["retry-after"]) >= 1
            assert state.healthy and not state.refused  # one timeout: not ejected, not refusing
            g = c.get(f"/v1/responses/{rid}")
            assert g.status_code == 503 and g.json()["error"]["param"] == "response_id", g.text
        finally:
            engine.proc.send_signal(signal.SIGCONT)
        until(lambda: respond(c, rid).status_code == 200, "the chain goes on once the engine answers")


@pytest.mark.redis
def test_a_degraded_store_that_lacks_the_owner_is_a_503_not_a_not_found(two: list[StandIn]) -> None:
    rp = RedisProcess()
    rp.start()
    try:
        cfg = config(two, sessions={"backend": "redis", "redis_url": rp.url, "redis_retry_s": 0.2})
        with ServedGateway(cfg) as gw, httpx.Client(base_url=gw.url, timeout=30) as c:
            wait_ready(gw.url)
            known = respond(c)
            assert known.status_code == 200, known.text
            rp.stop()
            r = respond(c, "resp_recorded_by_another_replica")
            assert r.status_code == 503, r.text
            err = r.json()["error"]
            assert err["code"] == "session_store_unavailable" and err["param"] == "previous_response_id"
            assert int(r.headers["retry-after"]) >= 1
            # what this replica recorded still routes from its local view
            r = respond(c, known.json()["id"])
            assert r.status_code == 200 and r.headers["x-agentgw-reason"] == "owner", r.text
            rp.start()
            until(lambda: c.get("/ready").json()["degraded"] is False, "the store back from Redis")
            r = respond(c, "resp_recorded_by_another_replica")
            assert r.status_code == 400 and r.json()["error"]["code"] == "previous_response_not_found"
    finally:
        rp.stop()
