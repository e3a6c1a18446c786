"""A turn refused at admission leaves its session exactly as it was: the stored record (home,
turns, prefix hashes), the prompt tokens kept for a KV prefetch, the planned move and the pins.
Analysis only reads; the one write, :meth:`Placement.place`, comes after admission. Before, the
analysis kept the refused turn's tokens as the session's (a 429 or 503 replaced what the
re-homer and the planner then prefetched).

Stand-in engines declaring a control API (``control_url``: the gateway keeps token ids and
plans moves for them); the same check on real engine_ext engines is in
tests/migrations/test_migrations_e2e.py."""

from __future__ import annotations

import asyncio
import socket
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import orjson
import pytest

from gateway.service.tenants import key_digest
from tests.conftest import ServedGateway, fake_engine, wait_ready
from tests.gateway.test_hostile_round3 import answer, head, opened, wait_until

MODEL = "m"
KEY, ONE = "sk-refused-a", "sk-refused-one"


@pytest.fixture
def engine_url() -> Iterator[str]:
    """A stand-in engine of the test's own: its streams are held until the first release."""
    with fake_engine("--model", MODEL, "--hold") as url:
        yield url


@pytest.fixture
def gw(engine_url: str, tiny_llama: Path) -> Iterator[ServedGateway]:
    engine = {"name": "e0", "url": engine_url, "model": MODEL, "control_url": engine_url}
    cfg = {
        "pools": [{"name": "any", "role": "any", "engines": [engine]}],
        "models": [{"name": MODEL, "tokenizer": str(tiny_llama), "block_size": 16, "hash_seed": "0"}],
        "analysis": {"mode": "inline"},
        "auth": {
            "tenants": [
                {"name": "a", "key_sha256": [key_digest(KEY)]},
                {"name": "one", "key_sha256": [key_digest(ONE)], "max_concurrent": 1},
            ]
        },
        # one request in flight at a time, per gateway and per engine, and no queues
        "admission": {
            "max_inflight": 1,
            "max_queue": 0,
            "max_inflight_per_engine": 1,
            "max_queue_per_engine": 0,
        },
        "migration": {"control_token": "t"},
    }
    with ServedGateway(cfg) as g:
        wait_ready(g.url)
        yield g


def turn(session: str, text: str, stream: bool = False) -> dict[str, Any]:
    return {
        "model": MODEL,
        "max_tokens": 2,
        "stream": stream,
        "messages": [{"role": "user", "content": text}],
        "agent_hints": {"session_id": session, "expected_tool_latency_ms": 4000},
    }


def state(gw: ServedGateway, tenant: str, session: str) -> dict[str, Any]:
    """Everything a turn may change of its session."""
    svc = gw.service
    sid = f"{tenant}:{session}"
    assert gw.loop is not None
    rec = asyncio.run_coroutine_threadsafe(svc.sessions.get(sid, svc.clock()), gw.loop).result(10)
    current = svc.migrations.current.get(sid)
    return {
        "record": None
        if rec is None
        else {k: v for k, v in rec.to_dict().items() if k not in ("last_activity", "observed_gaps")},
        "tokens": svc.prompts.session_tokens(sid),
        "move": None if current is None else current.to_dict(),
    }


def held_stream(gw: ServedGateway, key: str, session: str) -> socket.socket:
    """A streamed turn that holds its admission slot until the engine is released."""
    body = orjson.dumps(turn(session, "hold the slot", stream=True))
    s = opened(gw, head("/v1/chat/completions", key, len(body)) + body)
    wait_until(lambda: gw.service.admission.inflight == 1, "the stream holds the slot")
    return s


def release(gw: ServedGateway, engine_url: str, s: socket.socket) -> None:
    httpx.post(engine_url + "/release", timeout=10)
    s.close()
    wait_until(lambda: gw.service.admission.inflight == 0, "the stream ended")


def post_turn(gw: ServedGateway, key: str, session: str, text: str) -> httpx.Response:
    return httpx.post(
        gw.url + "/v1/chat/completions",
        json=turn(session, text),
        headers={"authorization": f"Bearer {key}"},
        timeout=30,
    )


def first_turn(gw: ServedGateway, key: str, tenant: str, session: str, text: str) -> dict[str, Any]:
    """An admitted turn, settled: the session's state after it."""
    r = post_turn(gw, key, session, text)
    assert r.status_code == 200, r.text
    wait_until(lambda: state(gw, tenant, session)["record"] is not None, "the first turn settled")
    return state(gw, tenant, session)


@pytest.mark.parametrize("where", ["gateway_slot", "engine_slot"])
def test_a_turn_refused_after_its_analysis_changes_nothing(
    gw: ServedGateway, engine_url: str, where: str
) -> None:
    session = f"refused-{where}"
    before = first_turn(gw, KEY, "a", session, "the first turn " * 40)
    assert before["tokens"], "the admitted turn's tokens are kept (the engine declares a control API)"
    if where == "engine_slot":  # the gateway has room, the engine has not
        gw.service.admission.config = gw.service.admission.config.model_copy(update={"max_inflight": 8})
        gw.service.admission.global_slots.limit = 8
    hold = held_stream(gw, KEY, f"holder-{where}")
    try:
        r = post_turn(gw, KEY, session, "a different second turn " * 60)
        assert r.status_code == 503, r.text
        assert r.json()["error"]["code"] == ("gateway_busy" if where == "gateway_slot" else "engine_busy")
        after = state(gw, "a", session)
    finally:
        release(gw, engine_url, hold)
    assert after == before  # tokens included: the refused prompt is not the session's
    # the next admitted turn is kept
    r = post_turn(gw, KEY, session, "the third turn " * 50)
    assert r.status_code == 200, r.text
    wait_until(lambda: state(gw, "a", session)["tokens"] != before["tokens"], "the third turn's tokens kept")


def test_a_turn_refused_by_its_tenants_limit_changes_nothing(gw: ServedGateway) -> None:
    session = "refused-tenant"
    before = first_turn(gw, ONE, "one", session, "first " * 80)
    body = orjson.dumps(turn(session, "a second turn " * 40))
    hog = opened(gw, head("/v1/chat/completions", ONE, len(body)) + body[:5])  # holds the tenant's slot
    try:
        wait_until(lambda: gw.service.admission.tenants["one"].inflight == 1, "the hog entered")
        s = opened(gw, head("/v1/chat/completions", ONE, len(body)) + body)
        status, _, raw = answer(s)
        s.close()
        assert (status, orjson.loads(raw)["error"]["code"]) == (429, "tenant_concurrency")
        assert state(gw, "one", session) == before
    finally:
        hog.close()
