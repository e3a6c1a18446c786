"""The turn pipeline owns a request's life: a turn refused by admission (429, 503) or abandoned by
its client before it was admitted writes nothing (the session's record, the prefix indexes, the
homes and siblings, the admission counters are as they were), and only the pipeline orders the
stages, none of which calls into the HTTP edge. Served gateway, stand-in engines on loopback."""

from __future__ import annotations

import asyncio
import socket
import sys
import time
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path
from types import FrameType
from typing import Any

import httpx
import orjson
import pytest

from gateway.api.app import create_app
from gateway.config import load_config
from gateway.core.turn import IndexKind
from gateway.service.tenants import key_digest
from tests.conftest import ServedGateway, fake_engine, wait_ready

MODEL = "m"
KEY = "sk-acme-1"


def chat(turns: int) -> dict[str, Any]:
    messages = [{"role": "system", "content": "rules: keep the diff small. " * 60}]
    for t in range(turns):
        messages += [
            {"role": "user", "content": f"step {t}: read the file and fix it. " * 30},
            {"role": "assistant", "content": f"done {t}: patched the function. " * 30},
        ]
    messages.append({"role": "user", "content": "next: run the tests."})
    return {"model": MODEL, "messages": messages, "max_tokens": 4}


def config(urls: list[str], **extra: Any) -> dict[str, Any]:
    return {
        "pools": [
            {
                "name": "p",
                "role": "any",
                "engines": [{"name": f"e{i}", "url": u, "model": MODEL} for i, u in enumerate(urls)],
            }
        ],
        "timeouts": {"health_interval_s": 0.5, "metrics_interval_s": 0.5},
        **extra,
    }


def on_loop(gw: ServedGateway, coro: Any) -> Any:
    assert gw.loop is not None
    return asyncio.run_coroutine_threadsafe(coro, gw.loop).result(10)


def state(gw: ServedGateway, sid: str) -> dict[str, Any]:
    """What a turn of session ``sid`` could change, read on the gateway's loop."""

    async def read() -> dict[str, Any]:
        svc = gw.service
        core = svc.placement.core
        rec = await svc.sessions.get(sid, svc.clock())
        approx = core.indexes[IndexKind.APPROX]
        engines = list(svc.cluster.engines)
        adm = svc.admission
        return {
            "record": rec.to_dict() if rec is not None else None,
            "approx_blocks": {e: approx.engine_blocks(e) for e in engines},
            "homes": {e: core.homes.on_engine(e) for e in engines},
            "homed": dict(core.homes.homed(svc.clock())),
            "siblings": len(core.siblings),
            "admission": (adm.inflight, adm.waiting, {t: s.inflight for t, s in adm.tenants.items()}),
            "decisions": sum(
                s.value
                for m in svc.metrics.decisions.collect()
                for s in m.samples
                if s.name.endswith("_total")
            ),
        }

    return on_loop(gw, read())  # type: ignore[no-any-return]


@pytest.fixture(scope="module")
def engines() -> Iterator[list[str]]:
    with (
        fake_engine("--model", MODEL, "--tokens", "4") as a,
        fake_engine("--model", MODEL, "--tokens", "4") as b,
    ):
        yield [a, b]


@pytest.fixture(scope="module")
def slow() -> Iterator[str]:
    with fake_engine("--model", MODEL, "--tokens", "60", "--itl-ms", "100") as url:
        yield url


def headers(sid: str, key: str | None = None) -> dict[str, str]:
    h = {"x-agent-session-id": sid}
    return h | {"authorization": f"Bearer {key}"} if key else h


def test_a_turn_refused_by_the_tenants_rate_limit_writes_nothing(engines: list[str]) -> None:
    auth = {
        "tenants": [{"name": "acme", "key_sha256": [key_digest(KEY)], "requests_per_s": 0.01, "burst_s": 1}]
    }
    with ServedGateway(config(engines, auth=auth)) as gw, httpx.Client(base_url=gw.url, timeout=30) as c:
        wait_ready(gw.url)
        r = c.post("/v1/chat/completions", json=chat(1), headers=headers("s", KEY))
        assert r.status_code == 200, r.text
        before = state(gw, "acme:s")
        assert before["record"]["turns"] == 1 and before["record"]["inflight"] == 0
        r = c.post("/v1/chat/completions", json=chat(2), headers=headers("s", KEY))
        assert r.status_code == 429 and r.json()["error"]["code"] == "tenant_rate_limited"
        assert r.headers["retry-after"]
        assert state(gw, "acme:s") == before


def test_a_turn_refused_for_capacity_writes_nothing(engines: list[str], slow: str) -> None:
    # one engine slot: a long stream holds it, so the session's next turn gets the 503
    admission = {"max_inflight_per_engine": 1, "max_queue_per_engine": 0}
    with (
        ServedGateway(config([slow], admission=admission)) as gw,
        httpx.Client(base_url=gw.url, timeout=30) as c,
    ):
        wait_ready(gw.url)
        r = c.post("/v1/chat/completions", json={**chat(1), "max_tokens": 1}, headers=headers("s"))
        assert r.status_code == 200, r.text
        body = {**chat(0), "stream": True, "max_tokens": 60}  # 6 s of tokens
        with c.stream("POST", "/v1/chat/completions", json=body, headers=headers("holder")) as held:
            assert held.status_code == 200
            chunks = held.iter_raw()  # kept: a dropped iterator closes the stream
            next(chunks)  # the holder is streaming: it has the slot
            before = state(gw, "s")
            r = c.post("/v1/chat/completions", json=chat(2), headers=headers("s"))
            assert r.status_code == 503 and r.json()["error"]["code"] == "engine_busy"
            assert state(gw, "s") == before


def test_a_turn_abandoned_while_it_waits_for_admission_writes_nothing(slow: str) -> None:
    admission = {"max_inflight": 1, "max_queue": 4, "queue_timeout_s": 30}
    with (
        ServedGateway(config([slow], admission=admission)) as gw,
        httpx.Client(base_url=gw.url, timeout=30) as c,
    ):
        wait_ready(gw.url)
        r = c.post("/v1/chat/completions", json={**chat(1), "max_tokens": 1}, headers=headers("s"))
        assert r.status_code == 200, r.text
        body = {**chat(0), "stream": True, "max_tokens": 60}  # 6 s of tokens
        with c.stream("POST", "/v1/chat/completions", json=body, headers=headers("holder")) as held:
            assert held.status_code == 200
            chunks = held.iter_raw()
            next(chunks)
            before = state(gw, "s")
            adm = gw.service.admission
            body = orjson.dumps(chat(2))
            host, port = gw.url.removeprefix("http://").split(":")
            with socket.create_connection((host, int(port)), timeout=10) as quitter:
                quitter.sendall(
                    b"POST /v1/chat/completions HTTP/1.1\r\nhost: gw\r\ncontent-type: application/json\r\n"
                    + b"x-agent-session-id: s\r\ncontent-length: %d\r\n\r\n" % len(body)
                    + body
                )
                assert until(lambda: adm.waiting == 1), "the turn never queued"
            # the client is gone: the turn leaves the queue and writes nothing
            assert until(lambda: adm.waiting == 0)
            assert state(gw, "s") == before
            assert adm.stats.admitted == 2  # the first turn and the holder


def until(cond: Callable[[], bool], timeout_s: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if cond():
            return True
        time.sleep(0.02)
    return False


# -- the tracer ------------------------------------------------------------------------------

GATEWAY = Path(__file__).resolve().parents[2] / "gateway"
PIPELINE = GATEWAY / "service" / "turns.py"


def _where(frame: FrameType | None) -> str | None:
    if frame is None:
        return None
    f = frame.f_code.co_filename
    return str(Path(f).relative_to(GATEWAY)) if f.startswith(str(GATEWAY)) else None


def test_only_the_pipeline_orders_the_stages_and_no_stage_calls_the_edge(engines: list[str]) -> None:
    calls: list[tuple[str, str, str]] = []  # (caller file, callee file, callee name)

    def profile(frame: FrameType, event: str, _: object) -> None:
        if event != "call":
            return
        callee = _where(frame)
        up = frame.f_back
        while up is not None and _where(up) is None:  # through contextlib, asyncio: who asked
            up = up.f_back
        caller = _where(up)
        if callee is not None and caller is not None and callee != caller:
            calls.append((caller, callee, frame.f_code.co_qualname))

    async def one_turn(url: str) -> int:
        async with httpx.AsyncClient(base_url=url, timeout=30) as c:
            sys.setprofile(profile)
            try:
                r = await c.post("/v1/chat/completions", json=chat(1), headers=headers("traced"))
            finally:
                sys.setprofile(None)
            return r.status_code

    with ServedGateway(config(engines)) as gw:
        wait_ready(gw.url)
        assert on_loop(gw, one_turn(gw.url)) == 200
    pipeline = "service/turns.py"
    # the edge hands the turn over and is called back only through the pipeline's Edge
    into_service = {
        name for caller, callee, name in calls if caller == "api/relay.py" and callee.startswith("service/")
    }
    assert into_service == {"TenantRegistry.authenticate", "Turns.run"}, into_service
    into_api = {
        (caller, name)
        for caller, callee, name in calls
        if callee.startswith("api/") and not caller.startswith("api/")
    }
    assert into_api and {caller for caller, _ in into_api} == {pipeline}, into_api
    # the stages, in order, each entered from the pipeline and nowhere else
    stages = [
        "Turnstile.enter",
        "GatewayService.analyze",
        "GatewayService.decide",
        "Admission.admit",
        "Admission.engine_slot",
        "Placement.place",
        "GatewayService.open",
        "Placement.settle",
    ]
    order = [name for caller, _, name in calls if caller == pipeline and name in stages]
    firsts = [n for i, n in enumerate(order) if n not in order[:i]]
    assert firsts == stages, order
    for stage in stages:
        callers = {caller for caller, _, name in calls if name == stage}
        assert callers == {pipeline}, (stage, callers)
    # and the commit comes after admission: nothing written for a turn that is refused
    assert order.index("Placement.place") > order.index("Admission.engine_slot")


# -- without sockets -------------------------------------------------------------------------


def _sse(*events: bytes, fail: bool = False) -> AsyncIterator[bytes]:
    async def gen() -> AsyncIterator[bytes]:
        for e in events:
            yield b"data: " + e + b"\n\n"
        if fail:
            raise httpx.ReadError("connection reset by peer")

    return gen()


async def test_a_turn_runs_end_to_end_on_an_injected_transport() -> None:
    """The whole hot path (edge, pipeline, forwarding, relay) over ``httpx.MockTransport``: the
    engine is a function, the client an ASGI transport; no socket anywhere."""
    sent: list[dict[str, Any]] = []

    async def engine(request: httpx.Request) -> httpx.Response:
        if request.url.path != "/v1/chat/completions":
            return httpx.Response(200, text="")  # /health, /metrics
        body = orjson.loads(request.content)
        sent.append(body)
        chunk = orjson.dumps({"choices": [{"index": 0, "delta": {"content": "hi"}}]})
        events = _sse(chunk, b"[DONE]", fail=body["messages"][-1]["content"] == "fail")
        return httpx.Response(200, headers={"content-type": "text/event-stream"}, content=events)

    cfg = load_config(None, **config(["http://e0.test", "http://e1.test"]))
    app = create_app(cfg, transport=httpx.MockTransport(engine))
    async with (
        app.api.router.lifespan_context(app.api),
        httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://gw") as c,
    ):
        body = {**chat(1), "stream": True}
        r = await c.post("/v1/chat/completions", json=body, headers=headers("s"))
        assert r.status_code == 200 and r.headers["x-agentgw-reason"] == "new_session"
        assert r.text.endswith("data: [DONE]\n\n") and '"hi"' in r.text
        home = r.headers["x-agentgw-engine"]
        assert sent[-1]["messages"] == body["messages"]
        svc = app.state.service
        rec = await svc.sessions.get("s", svc.clock())
        assert rec is not None and rec.home == home and rec.turns == 1 and rec.inflight == 0
        # the engine dies mid-stream: the stream ends with the API's error event, counted
        failing = {**body, "messages": [*body["messages"], {"role": "user", "content": "fail"}]}
        r = await c.post("/v1/chat/completions", json=failing, headers=headers("s"))
        assert r.status_code == 200 and '"code":"upstream_error"' in r.text.replace(" ", "")
        assert r.text.endswith("data: [DONE]\n\n")
        failed = svc.metrics.requests.labels("/v1/chat/completions", "502", "p", home)._value.get()
        assert failed == 1
        rec = await svc.sessions.get("s", svc.clock())
        assert rec is not None and rec.turns == 1 and rec.inflight == 0  # settled, not counted as a turn
