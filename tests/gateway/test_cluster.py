"""Active health: ejection after failed probes, re-admission on recovery; metrics scraping."""

from __future__ import annotations

import httpx
import pytest

from gateway.config import load_config
from gateway.service.cluster import Cluster, parse_vllm_gauges

CFG = {
    "pools": [
        {
            "name": "p",
            "role": "warm",
            "engines": [
                {"name": "a", "url": "http://a:1", "model": "m"},
                {"name": "b", "url": "http://b:1", "model": "m"},
            ],
        }
    ],
    "limits": {"eject_after_failures": 2, "readmit_after_successes": 2},
}

METRICS = b"""# HELP vllm:num_requests_running x
vllm:num_requests_running{engine="0",model_name="m"} 3.0
vllm:num_requests_waiting{engine="0",model_name="m"} 2.0
vllm:kv_cache_usage_perc{engine="0",model_name="m"} 0.25
vllm:num_requests_running_other 9
"""


@pytest.fixture
def state() -> dict[str, bool]:
    return {"a": True, "b": True}


@pytest.fixture
def cluster(state: dict[str, bool]) -> Cluster:
    def handler(request: httpx.Request) -> httpx.Response:
        host = request.url.host
        if not state[host]:
            raise httpx.ConnectError("refused", request=request)
        if request.url.path == "/metrics":
            return httpx.Response(200, content=METRICS)
        return httpx.Response(200)

    client = httpx.AsyncClient(transport=httpx.MockTransport(handler))
    return Cluster(load_config(None, **CFG), client)


async def test_eject_after_failures_and_readmit_after_successes(
    cluster: Cluster, state: dict[str, bool]
) -> None:
    await cluster.probe_once()  # both up: admitted
    state["a"] = False
    await cluster.probe_once()
    assert cluster.engines["a"].healthy  # one failure is not enough
    await cluster.probe_once()
    assert not cluster.engines["a"].healthy
    assert cluster.ready() == {"p": True}
    assert [v.name for v in cluster.views() if v.healthy] == ["b"]
    state["a"] = True
    await cluster.probe_once()
    assert not cluster.engines["a"].healthy
    await cluster.probe_once()
    assert cluster.engines["a"].healthy
    assert all(v.healthy for v in cluster.views())


async def test_connect_failure_ejects_at_once(cluster: Cluster) -> None:
    cluster.record_connect_failure("b")
    assert not cluster.engines["b"].healthy
    assert cluster.models() == ["m"]


async def test_scrape_reads_vllm_load(cluster: Cluster) -> None:
    await cluster.scrape_once()
    v = next(v for v in cluster.views() if v.name == "a")
    assert (v.running, v.waiting, v.kv_usage, v.queue) == (3, 2, 0.25, 5)
    cluster.begin("a")
    assert next(v for v in cluster.views() if v.name == "a").inflight == 1


def test_parse_gauges_ignores_other_metrics() -> None:
    assert parse_vllm_gauges(METRICS) == {"running": 3.0, "waiting": 2.0, "kv_usage": 0.25}


def _panic_cluster(state: dict[str, str], threshold: float = 0.0) -> Cluster:
    """Engines answer probes ("ok"), time out ("slow": alive but loaded) or refuse ("down")."""

    def handler(request: httpx.Request) -> httpx.Response:
        mode = state[request.url.host]
        if mode == "down":
            raise httpx.ConnectError("refused", request=request)
        if mode == "slow":
            raise httpx.ReadTimeout("probe timed out", request=request)
        return httpx.Response(200)

    cfg = {
        **CFG,
        "limits": {"eject_after_failures": 2, "readmit_after_successes": 1, "panic_threshold": threshold},
    }
    return Cluster(load_config(None, **cfg), httpx.AsyncClient(transport=httpx.MockTransport(handler)))


def _route(cluster: Cluster) -> str:
    from gateway.core.router import Router, RoutingParams
    from gateway.core.types import RouteRequest, Snapshot

    router = Router(RoutingParams(profile="least_loaded"))
    return router.route(
        RouteRequest(model="m", prompt_tokens=10, block_size=16), Snapshot(cluster.views())
    ).engine


async def test_panic_keeps_a_pool_of_live_but_slow_engines_in_service() -> None:
    state = {"a": "ok", "b": "ok"}
    cluster = _panic_cluster(state)
    await cluster.probe_once()  # both up once: admitted
    state["a"] = state["b"] = "slow"
    for _ in range(2):
        await cluster.probe_once()
    assert not cluster.engines["a"].healthy and not cluster.engines["b"].healthy  # both ejected
    assert cluster.panicking() == {"p": True}
    assert all(v.healthy for v in cluster.views()) and cluster.routable("a") and cluster.routable("b")
    assert _route(cluster) in {"a", "b"}  # used to be NoEngine -> 502/503
    assert cluster.models() == ["m"]
    state["a"] = "down"  # refused connections: really gone, stays out even in panic
    await cluster.probe_once()
    assert [v.name for v in cluster.views() if v.healthy] == ["b"] and not cluster.routable("a")
    assert _route(cluster) == "b"
    state["b"] = "ok"  # one engine passes again: panic over, health is obeyed
    await cluster.probe_once()
    assert cluster.panicking() == {"p": False}
    assert [v.name for v in cluster.views() if v.healthy] == ["b"]


async def test_panic_threshold_as_a_fraction_of_the_pool() -> None:
    states = [{"a": "ok", "b": "ok"}, {"a": "ok", "b": "ok"}]
    strict, lenient = _panic_cluster(states[0]), _panic_cluster(states[1], threshold=0.5)
    for c, state in zip((strict, lenient), states, strict=True):
        await c.probe_once()  # both up once
        state["a"] = "slow"
        for _ in range(2):
            await c.probe_once()
    assert strict.panicking() == {"p": False} and [v.name for v in strict.views() if v.healthy] == ["b"]
    assert lenient.panicking() == {"p": True} and all(v.healthy for v in lenient.views())


async def test_passive_connect_failure_marks_the_engine_refused() -> None:
    cluster = _panic_cluster({"a": "ok", "b": "ok"})
    cluster.record_connect_failure("a")
    cluster.record_connect_failure("b")
    assert cluster.panicking() == {"p": True}
    assert not any(v.healthy for v in cluster.views())  # nothing listens: no panic routing to them


async def test_an_engine_that_never_answered_is_starting_and_out_of_routing(
    cluster: Cluster, state: dict[str, bool]
) -> None:
    """A gateway started before its engines: the first refused probe takes an engine out (no
    second probe needed, nothing to eject), ``waiting`` says why, and its first answer admits it
    (``readmit_after_successes`` is 2 here: that is for an engine that was up and failed)."""
    state["a"] = state["b"] = False
    await cluster.probe_once()
    assert cluster.ready() == {"p": False}
    assert cluster.waiting() == {"a": "starting", "b": "starting"}
    assert cluster.starting() == ["a", "b"]
    assert not any(v.healthy for v in cluster.views())  # refused: out even though the pool panics
    state["a"] = True
    await cluster.probe_once()
    assert cluster.ready() == {"p": True} and cluster.waiting() == {"b": "starting"}
    assert [v.name for v in cluster.views() if v.healthy] == ["a"] and cluster.starting() == ["b"]
    state["a"] = False  # up once, then down: the usual ejection after eject_after_failures
    await cluster.probe_once()
    assert cluster.engines["a"].healthy
    await cluster.probe_once()
    assert cluster.waiting() == {"a": "refusing connections", "b": "starting"}


async def test_a_starting_engine_that_accepts_but_does_not_answer_stays_out_even_in_panic() -> None:
    """vLLM binds its port before its engine is built: a starting engine's probe times out
    instead of being refused. A panicking pool serves live-but-slow engines, not ones that never
    answered."""
    state = {"a": "slow", "b": "slow"}
    cluster = _panic_cluster(state)
    await cluster.probe_once()
    assert cluster.panicking() == {"p": True}
    assert not any(v.healthy for v in cluster.views()) and not cluster.routable("a")
    assert cluster.waiting() == {"a": "starting", "b": "starting"}
    state["a"] = "ok"
    await cluster.probe_once()
    state["a"] = "slow"  # up once, then slow: the panic serves it again
    for _ in range(2):
        await cluster.probe_once()
    assert cluster.panicking() == {"p": True}
    assert cluster.routable("a") and not cluster.routable("b")


def test_a_refused_owner_is_gone_unless_a_response_was_stored_on_it_since() -> None:
    """Another replica stored a response on an engine this replica last saw refusing (it
    restarted; this replica's probes have not seen it yet): a 503 to retry, not not-found."""
    from gateway.errors import Refused

    now = [100.0]
    c = Cluster(load_config(None, **CFG), httpx.AsyncClient(), clock=lambda: now[0])
    c.record_probe("a", True)
    c.record_connect_failure("a")  # refused at 100
    assert c.engines["a"].refused and c.engines["a"].refused_at == 100.0
    c.owner_unavailable("a", "previous_response_id", stored_at=99.0)  # stored before: gone
    c.owner_unavailable("a", "previous_response_id")  # no record time: gone
    with pytest.raises(Refused) as e:
        c.owner_unavailable("a", "previous_response_id", stored_at=101.0)
    assert e.value.code == "owner_unavailable" and "restarted" in str(e.value)
    now[0] = 102.0
    c.record_probe("a", False, refused=True)  # refused again, after that response: gone now
    c.owner_unavailable("a", "previous_response_id", stored_at=101.0)
