"""Defects found by the fourth round of hostile probing (a fair but hostile user against a real
gateway on loopback, uvicorn with the server limits, a stand-in engine as a subprocess), each with
the check that failed before its fix: token counting outside every limit, and admin bodies read
whole and parsed by a recursive parser. (The third defect, the engines' control token in their
process arguments, is tested where engines start: tests/engine_ext/test_control.py,
tests/agents/test_stack_options.py, tests/local/test_launch_replicas.py.)"""

from __future__ import annotations

import socket
from collections.abc import Iterator
from typing import Any

import httpx
import orjson
import pytest
from starlette.routing import Route

from gateway.api.app import HOT_ROUTES
from gateway.service.tenants import key_digest
from tests.conftest import ServedGateway, engine_metric, fake_engine, wait_ready
from tests.gateway.test_hostile_round3 import answer, head, opened, wait_until

ADMIN, LIMITED, FREE, OPEN = "sk-admin-4", "sk-limited-4", "sk-free-4", "sk-open-4"
MODEL = "m"


def hdr(key: str) -> dict[str, str]:
    return {"authorization": f"Bearer {key}"}


def messages(content: str) -> dict[str, Any]:
    return {"model": MODEL, "max_tokens": 2, "messages": [{"role": "user", "content": content}]}


@pytest.fixture(scope="module")
def engine_url() -> Iterator[str]:
    with fake_engine("--model", MODEL, "--hold") as url:
        yield url


LIMITS = {"max_body_bytes": 64 * 1024, "max_session_body_bytes": 16 * 1024, "max_admin_body_bytes": 16 * 1024}


@pytest.fixture(scope="module")
def gw(engine_url: str) -> Iterator[ServedGateway]:
    cfg = {
        "pools": [
            {"name": "any", "role": "any", "engines": [{"name": "e0", "url": engine_url, "model": MODEL}]}
        ],
        "auth": {
            "tenants": [
                # 2 req/s with a 1 s burst: two calls at once, then 429s
                {"name": "limited", "key_sha256": [key_digest(LIMITED)], "requests_per_s": 2, "burst_s": 1},
                {"name": "free", "key_sha256": [key_digest(FREE)], "max_concurrent": 1},
                {"name": "open", "key_sha256": [key_digest(OPEN)]},
            ],
            "admin_key_sha256": [key_digest(ADMIN)],
        },
        "limits": LIMITS,
        # one request in flight at a time and no queue: a held stream fills the gateway
        "admission": {"max_inflight": 1, "max_queue": 0},
    }
    with ServedGateway(cfg) as g:
        wait_ready(g.url)
        yield g


def counted(engine_url: str) -> int:
    return int(engine_metric(engine_url, "fake_engine_count_tokens_total"))


# -- 1. /v1/messages/count_tokens inside the tenant's limits and the gateway's admission ----------
def test_count_tokens_is_held_to_the_tenants_request_rate(gw: ServedGateway, engine_url: str) -> None:
    """A tenant limited to 2 req/s had 12 of 12 back-to-back count_tokens calls answered 200 (and
    forwarded to the engine) while its chat calls got 429s. Now the calls past the bucket get
    Anthropic's 429 with a Retry-After, before the engine sees them."""
    before = counted(engine_url)
    with httpx.Client(base_url=gw.url, timeout=30) as c:
        codes = []
        for _ in range(12):
            r = c.post("/v1/messages/count_tokens", json=messages("count me"), headers=hdr(LIMITED))
            codes.append(r.status_code)
            if r.status_code == 429:
                doc = r.json()
                assert doc["type"] == "error" and doc["error"]["type"] == "rate_limit_error", doc
                assert int(r.headers["retry-after"]) >= 1
    assert codes.count(200) == 2 and codes.count(429) == 10, codes  # the burst of 2, then the limit
    assert counted(engine_url) - before == 2  # the refused ones never reached the engine


def test_count_tokens_counts_against_the_tenants_concurrency(gw: ServedGateway) -> None:
    """A request still sending its body holds the tenant's only slot: a count_tokens call of the
    same tenant is refused with ``tenant_concurrency``, before its body is read."""
    body = orjson.dumps(messages("slow"))
    hog = opened(gw, head("/v1/messages/count_tokens", FREE, len(body)) + body[:5])
    try:
        wait_until(lambda: gw.service.admission.tenant_inflight(_tenant(gw, "free")) == 1, "the hog entered")
        s = opened(gw, head("/v1/messages/count_tokens", FREE, len(body)) + body)
        status, _, raw = answer(s)
        s.close()
        assert (status, orjson.loads(raw)["error"]["type"]) == (429, "rate_limit_error"), raw
        assert "concurrent" in orjson.loads(raw)["error"]["message"]
    finally:
        hog.close()
    wait_until(lambda: gw.service.admission.tenant_inflight(_tenant(gw, "free")) == 0, "the hog left")
    r = httpx.post(gw.url + "/v1/messages/count_tokens", json=messages("now"), headers=hdr(FREE), timeout=30)
    assert r.status_code == 200 and r.json()["input_tokens"] > 0, r.text


def test_count_tokens_waits_for_the_gateways_admission(gw: ServedGateway, engine_url: str) -> None:
    """The gateway admits one request at a time with no queue: while a held stream has the slot,
    count_tokens gets the gateway's 503 ``gateway_busy`` (it went straight to the engine before)."""
    body = orjson.dumps({**messages("hold"), "stream": True})
    s = opened(gw, head("/v1/chat/completions", FREE, len(body)) + body)
    try:
        wait_until(lambda: gw.service.admission.inflight == 1, "the stream holds the slot")
        before = counted(engine_url)
        r = httpx.post(
            gw.url + "/v1/messages/count_tokens", json=messages("x"), headers=hdr(OPEN), timeout=30
        )
        assert r.status_code == 503, r.text
        assert r.json()["type"] == "error" and "gateway" in r.json()["error"]["message"], r.text
        assert counted(engine_url) == before
    finally:
        httpx.post(engine_url + "/release", timeout=10)
        s.close()
    wait_until(lambda: gw.service.admission.inflight == 0, "the stream ended")


def _tenant(gw: ServedGateway, name: str) -> Any:
    return gw.service.tenants.tenants[name]


# -- 2. every route that reads a body: bounded and depth-limited ----------------------------------
BODYLESS = {
    ("POST", "/admin/reload"): "re-reads the config file; its body is ignored",
    ("POST", "/v1/responses/{response_id}/cancel"): "the id is in the path",
    ("DELETE", "/v1/responses/{response_id}"): "the id is in the path",
    ("DELETE", "/v1/agent/sessions/{session_id}"): "the id is in the path",
}
"""Routes with a body method that read no body (each says why)."""

WRONG_METHOD = {"PUT", "DELETE", "PATCH"}
"""The generation paths answer these with a 405 without reading anything."""


def body_routes(gw: ServedGateway) -> list[tuple[str, str]]:
    """Every (method, path) the app registers with a method that carries a body: the generation
    endpoints (dispatched before FastAPI) and every route of FastAPI's table."""
    out = [("POST", path) for path in HOT_ROUTES]
    for route in gw.app.api.router.routes:
        if not isinstance(route, Route):
            continue
        for method in sorted((route.methods or set()) & {"POST", "PUT", "PATCH", "DELETE"}):
            out.append((method, route.path))
    return out


def concrete(path: str) -> str:
    return path.replace("{response_id}", "resp_x").replace("{session_id}", "sess-x").replace("{name}", "x")


def test_the_sweep_finds_the_routes_it_must_cover(gw: ServedGateway) -> None:
    """The sweep below reads the app's own route table: a new route is in it the day it lands."""
    found = set(body_routes(gw))
    for must in [
        ("PUT", "/admin/pools"),
        ("POST", "/v1/messages/count_tokens"),
        ("POST", "/v1/agent/sessions/{session_id}/hints"),
        ("POST", "/debug/route"),
        *BODYLESS,
    ]:
        assert must in found, must
    assert ("POST", "/v1/chat/completions") in found and ("PUT", "/v1/messages") in found


@pytest.mark.parametrize("kind", ["oversized", "nested"])
def test_every_route_that_reads_a_body_bounds_it_and_limits_its_depth(gw: ServedGateway, kind: str) -> None:
    """``PUT /admin/pools`` read a 40 MB body whole (no 413) and answered 5,000 levels of nesting
    with a text/plain 500 (a RecursionError). Now every route that reads a body reads it through
    the generation endpoints' bounded, depth-limited reader: past its limit a 413, nested past
    1,024 levels a 400 ``invalid_json``, each as a JSON error, never a 5xx."""
    if kind == "oversized":
        data = orjson.dumps({"pad": "x" * (LIMITS["max_body_bytes"] + 1024)})
    else:
        depth = 5000
        data = b'{"a":' + b"[" * depth + b"]" * depth + b"}"
        assert len(data) < LIMITS["max_admin_body_bytes"]
    seen = []
    with httpx.Client(base_url=gw.url, timeout=60) as c:
        for method, path in body_routes(gw):
            if (method, path) in BODYLESS:
                continue
            url = concrete(path)
            r = c.request(
                method, url, content=data, headers={**hdr(ADMIN), "content-type": "application/json"}
            )
            seen.append((method, path, r.status_code))
            assert r.status_code < 500, (method, path, r.status_code, r.text[:300])
            assert r.headers["content-type"].startswith("application/json"), (method, path, r.headers)
            if method in WRONG_METHOD and r.status_code == 405:
                continue
            doc = r.json()
            err = doc["error"]
            if kind == "oversized":
                assert r.status_code == 413, (method, path, r.status_code, doc)
            else:
                assert r.status_code == 400 and err.get("code", err.get("type")) in (
                    "invalid_json",
                    "invalid_request_error",
                ), (method, path, doc)
                assert "JSON" in err["message"], (method, path, doc)
    assert len(seen) >= 8, seen


def test_admin_pools_takes_a_good_body_and_refuses_a_bad_one_in_openai_shape(gw: ServedGateway) -> None:
    with httpx.Client(base_url=gw.url, timeout=30) as c:
        r = c.put("/admin/pools", content=b"[1]", headers=hdr(ADMIN))
        assert (r.status_code, r.json()["error"]["code"]) == (400, "invalid_json")
        r = c.put("/admin/pools", json={"pools": "no"}, headers=hdr(ADMIN))
        assert (r.status_code, r.json()["error"]["param"]) == (400, "pools")
        current = c.get("/admin/pools", headers=hdr(ADMIN)).json()["pools"]
        keep = [
            {
                "name": p["name"],
                "role": p["role"],
                "engines": [{"name": e["name"], "url": e["url"], "model": e["model"]} for e in p["engines"]],
            }
            for p in current
        ]
        r = c.put("/admin/pools", json={"pools": keep}, headers=hdr(ADMIN))
        assert r.status_code == 200, r.text
        assert [e["name"] for p in r.json()["pools"] for e in p["engines"]] == ["e0"]


def test_a_nested_admin_body_leaves_the_gateway_serving(gw: ServedGateway) -> None:
    """After the sweep the gateway still answers (no worker died of a RecursionError)."""
    with socket.create_connection(("127.0.0.1", gw.config.listen.port), timeout=10):
        pass
    r = httpx.post(
        gw.url + "/v1/messages/count_tokens", json=messages("alive"), headers=hdr(FREE), timeout=30
    )
    assert r.status_code == 200, r.text
