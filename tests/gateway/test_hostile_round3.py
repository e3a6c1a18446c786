"""Defects found by hostile probing (a fair but hostile user against a real gateway on loopback,
uvicorn with the server limits, a stand-in engine as a subprocess), each with the check that
failed before its fix: what one tenant can learn of or do to another, and what reaches an
engine."""

from __future__ import annotations

import socket
import time
from collections.abc import Iterator
from typing import Any

import httpx
import orjson
import pytest

from gateway.service.tenants import key_digest
from testing.recording_engine import RecordingEngine
from tests.conftest import ServedGateway, engine_metric, fake_engine, wait_ready

ACME, BETA, ADMIN = "sk-acme-1", "sk-beta-2", "sk-admin-3"
MODEL = "m"


def hdr(key: str) -> dict[str, str]:
    return {"authorization": f"Bearer {key}"}


@pytest.fixture(scope="module")
def engine_url() -> Iterator[str]:
    with fake_engine("--model", MODEL) as url:
        yield url


def config(engine_url: str, **kw: Any) -> dict[str, Any]:
    return {
        "pools": [
            {"name": "any", "role": "any", "engines": [{"name": "e0", "url": engine_url, "model": MODEL}]}
        ],
        "auth": {
            "tenants": [
                {"name": "acme", "key_sha256": [key_digest(ACME)]},
                {"name": "beta", "key_sha256": [key_digest(BETA)]},
            ],
            "admin_key_sha256": [key_digest(ADMIN)],
        },
        **kw,
    }


@pytest.fixture(scope="module")
def gw(engine_url: str) -> Iterator[ServedGateway]:
    with ServedGateway(config(engine_url, server={"max_header_bytes": 32768})) as g:
        wait_ready(g.url)
        yield g


def chat(content: str, **kw: Any) -> dict[str, Any]:
    return {"model": MODEL, "messages": [{"role": "user", "content": content}], "max_tokens": 2, **kw}


# -- what a tenant can learn of another ----------------------------------------------------------
def test_the_approximate_index_does_not_tell_one_tenant_what_another_sent(gw: ServedGateway) -> None:
    """No tokenizer is configured: prompts are hashed approximately. The approximate hashes were
    not salted, so a prompt another tenant had sent came back as cached tokens in
    ``x-agentgw-cached-tokens-est`` (chunk by chunk: an oracle for another tenant's text)."""
    secret = "acme's confidential system prompt, chunk after chunk. " * 60  # ~3.3K chars
    with httpx.Client(base_url=gw.url, timeout=30) as c:
        r = c.post("/v1/chat/completions", json=chat(secret), headers=hdr(ACME))
        assert r.status_code == 200, r.text
        assert int(r.headers["x-agentgw-cached-tokens-est"]) == 0
        r = c.post("/v1/chat/completions", json=chat(secret), headers=hdr(ACME))
        assert int(r.headers["x-agentgw-cached-tokens-est"]) > 0  # its own prefix: matched
        r = c.post("/v1/chat/completions", json=chat(secret), headers=hdr(BETA))
        assert r.status_code == 200, r.text
        assert int(r.headers["x-agentgw-cached-tokens-est"]) == 0  # another's: never
        assert r.headers["x-agentgw-reason"] != "prefix"

        # the dry run explains a named tenant's request, with that tenant's matches only
        def matched(tenant: str) -> int:
            r = c.post(f"/debug/route?tenant={tenant}", json=chat(secret), headers=hdr(ADMIN))
            assert r.status_code == 200, r.text
            assert r.json()["tenant"] == tenant
            return sum(m["blocks"] for m in r.json()["matches"].values())

        assert matched("acme") > 0
        assert matched("beta") > 0  # beta sent it too, under its own salt
        r = c.post("/debug/route", json=chat(secret + "tail"), headers=hdr(ADMIN))
        assert sum(m["blocks"] for m in r.json()["matches"].values()) == 0  # unsalted: nobody's
        r = c.post("/debug/route?tenant=nobody", json=chat(secret), headers=hdr(ADMIN))
        assert (r.status_code, r.json()["error"]["param"]) == (400, "tenant")
        r = c.post("/debug/route?tenant=acme", json=chat(secret), headers=hdr(BETA))
        assert (r.status_code, r.json()["error"]["code"]) == (403, "admin_required")


# -- what a tenant can do to another: the body budget and the tenant's limits ---------------------
KIB = 1024
SHARE = 256 * KIB


def head(path: str, key: str | None, length: int, extra: str = "") -> bytes:
    auth = f"authorization: Bearer {key}\r\n" if key else ""
    return (
        f"POST {path} HTTP/1.1\r\nHost: x\r\n{auth}content-type: application/json\r\n"
        f"content-length: {length}\r\n{extra}\r\n"
    ).encode()


def opened(g: ServedGateway, data: bytes, source: str = "127.0.0.1") -> socket.socket:
    s = socket.socket()
    s.settimeout(30)
    s.bind((source, 0))
    s.connect(("127.0.0.1", g.config.listen.port))
    s.sendall(data)
    return s


def answer(s: socket.socket) -> tuple[int, dict[str, str], bytes]:
    """The status, headers and body of the one response the server sends on ``s``."""
    raw = b""
    while b"\r\n\r\n" not in raw:
        part = s.recv(65536)
        if not part:
            break
        raw += part
    top, _, rest = raw.partition(b"\r\n\r\n")
    lines = top.decode("latin-1").split("\r\n")
    hdrs = {k.lower(): v.strip() for k, _, v in (line.partition(":") for line in lines[1:])}
    n = int(hdrs.get("content-length", "0"))
    while len(rest) < n:
        part = s.recv(65536)
        if not part:
            break
        rest += part
    return int(lines[0].split()[1]), hdrs, rest


def held(g: ServedGateway) -> int:
    return int(g.app.state.bodies.held)


def wait_until(check: Any, what: str) -> None:
    for _ in range(400):  # bounded: the server reads what was sent, or notices a close
        if check():
            return
        time.sleep(0.05)
    raise AssertionError(what)


@pytest.fixture(scope="module")
def budget_gw(engine_url: str) -> Iterator[ServedGateway]:
    cfg = config(
        engine_url,
        limits={
            "max_body_bytes": 64 << 20,
            "max_buffered_body_bytes": 4 * SHARE,
            "max_buffered_body_bytes_per_tenant": SHARE,
        },
        server={"body_timeout_s": 20.0},
    )
    cfg["auth"]["tenants"] += [
        {"name": "slow", "key_sha256": [key_digest("sk-slow")], "requests_per_s": 1, "burst_s": 1},
        {"name": "one", "key_sha256": [key_digest("sk-one")], "max_concurrent": 1},
        {"name": "tok", "key_sha256": [key_digest("sk-tok")], "tokens_per_s": 100, "burst_s": 1},
    ]
    with ServedGateway(cfg) as g:
        wait_ready(g.url)
        yield g


def test_announced_bodies_hold_nothing_and_one_tenant_cannot_take_the_budget(
    budget_gw: ServedGateway,
) -> None:
    """32 sockets each announcing 32 MiB and sending one byte claimed the whole budget on the
    declared length, for nothing: every other tenant got 503 ``overloaded`` until the body
    timeout. Now bytes are claimed as they arrive, and a tenant that really sends holds at most
    its share: the others' requests pass."""
    g = budget_gw
    big = chat("y" * (SHARE - 2 * KIB))
    hogs = [opened(g, head("/v1/chat/completions", ACME, 32 << 20) + b"{") for _ in range(32)]
    try:
        wait_until(lambda: held(g) == 32, f"held {held(g)}, expected the 32 bytes sent")
        r = httpx.post(g.url + "/v1/chat/completions", json=big, headers=hdr(BETA), timeout=30)
        assert r.status_code == 200, r.text
        # acme sends for real: its share fills, and only acme is refused past it
        fat = [opened(g, head("/v1/chat/completions", ACME, 1 << 20) + b" " * (SHARE // 4)) for _ in range(3)]
        wait_until(lambda: held(g) == 32 + 3 * SHARE // 4, f"held {held(g)}")
        s = opened(g, head("/v1/chat/completions", ACME, 1 << 20) + b" " * (SHARE // 2))
        status, hdrs, body = answer(s)
        s.close()
        assert (status, orjson.loads(body)["error"]["code"]) == (429, "tenant_body_budget")
        assert int(hdrs["retry-after"]) >= 1 and hdrs["connection"] == "close"
        r = httpx.post(g.url + "/v1/chat/completions", json=big, headers=hdr(BETA), timeout=30)
        assert r.status_code == 200, r.text
        for s in fat:
            s.close()
    finally:
        for s in hogs:
            s.close()
    wait_until(lambda: held(g) == 0, f"held {held(g)} after every client left")
    assert g.app.state.bodies.by_owner == {}


def test_without_keys_each_client_address_has_its_share(engine_url: str) -> None:
    cfg = config(
        engine_url,
        limits={"max_buffered_body_bytes": 4 * SHARE, "max_buffered_body_bytes_per_tenant": SHARE},
    )
    del cfg["auth"]
    with ServedGateway(cfg) as g:
        wait_ready(g.url)
        hog = opened(g, head("/v1/chat/completions", None, 1 << 20) + b" " * (SHARE - KIB), "127.0.0.2")
        try:
            wait_until(lambda: held(g) == SHARE - KIB, f"held {held(g)}")
            s = opened(g, head("/v1/chat/completions", None, 4 * KIB) + b" " * (2 * KIB), "127.0.0.2")
            status, _, body = answer(s)
            s.close()
            assert (status, orjson.loads(body)["error"]["code"]) == (429, "tenant_body_budget")
            # another address: its own share
            r = httpx.post(g.url + "/v1/chat/completions", json=chat("z" * (SHARE // 2)), timeout=30)
            assert r.status_code == 200, r.text
        finally:
            hog.close()


def test_a_tenants_rate_and_concurrency_limits_refuse_before_the_body_is_read(
    budget_gw: ServedGateway,
) -> None:
    """A rate-limited tenant's 429 was decided after reading, parsing and analysing its body:
    its refused requests cost the gateway full processing. Now the headers decide: the request
    announces a body and sends none of it, and still gets its 429 at once (before the fix it
    waited for the body)."""
    g = budget_gw
    body = orjson.dumps(chat("hello"))
    r = httpx.post(g.url + "/v1/chat/completions", content=body, headers=hdr("sk-slow"), timeout=30)
    assert r.status_code == 200, r.text
    s = opened(g, head("/v1/chat/completions", "sk-slow", len(body)))  # the body never comes
    status, hdrs, raw = answer(s)
    s.close()
    assert (status, orjson.loads(raw)["error"]["code"]) == (429, "tenant_rate_limited")
    assert hdrs["connection"] == "close" and int(hdrs["retry-after"]) >= 1

    # concurrency: a request still sending its body counts
    hog = opened(g, head("/v1/chat/completions", "sk-one", len(body)) + body[:5])
    try:
        wait_until(lambda: g.service.admission.tenants.get("one") is not None, "tenant 'one' seen")
        s = opened(g, head("/v1/chat/completions", "sk-one", len(body)))
        status, _, raw = answer(s)
        s.close()
        assert (status, orjson.loads(raw)["error"]["code"]) == (429, "tenant_concurrency")
    finally:
        hog.close()

    # tokens: estimated from the declared length before the body, settled after analysis
    r = httpx.post(g.url + "/v1/chat/completions", json=chat("w" * 2000), headers=hdr("sk-tok"), timeout=30)
    assert r.status_code == 200, r.text  # ~500 tokens: a bucket of 100 goes into debt
    s = opened(g, head("/v1/chat/completions", "sk-tok", 400))
    status, _, raw = answer(s)
    s.close()
    assert (status, orjson.loads(raw)["error"]["code"]) == (429, "tenant_token_rate_limited")


def test_requests_whose_clients_left_while_queued_never_reach_an_engine() -> None:
    """58 of 100 requests whose clients had left while queued in admission still reached the
    engines: the client was watched only once the engine was being reached."""
    with fake_engine("--model", MODEL, "--hold") as url:
        cfg = config(url, admission={"max_inflight": 1, "max_queue": 64, "queue_timeout_s": 60})
        del cfg["auth"]
        with ServedGateway(cfg) as g:
            wait_ready(g.url)
            adm = g.service.admission
            body = orjson.dumps(chat("queued", stream=True))
            first = opened(g, head("/v1/chat/completions", None, len(body)) + body)
            wait_until(lambda: adm.inflight == 1, "the first request holds the only slot")
            quitters = [opened(g, head("/v1/chat/completions", None, len(body)) + body) for _ in range(10)]
            wait_until(lambda: adm.waiting == 10, f"{adm.waiting} waiting, expected 10")
            for s in quitters:
                s.close()
            wait_until(lambda: adm.waiting == 0, f"{adm.waiting} still waiting after their clients left")
            assert httpx.post(url + "/release", timeout=10).status_code == 200
            status, _, _ = answer(first)
            first.close()
            assert status == 200
            wait_until(lambda: adm.inflight == 0, "every slot given back")
            metrics = httpx.get(g.url + "/metrics", timeout=10).text
            assert engine_metric(url, "fake_engine_requests_total") == 1  # the first one only
            assert (
                'agentgw_requests_total{engine="",pool="any",route="/v1/chat/completions",status="499"} 10.0'
                in metrics
            )


# -- what reaches a client when an engine fails ---------------------------------------------------
@pytest.mark.parametrize("cut", [0, 40])
def test_a_whole_answer_cut_by_its_engine_never_looks_complete(cut: int) -> None:
    """A non-streamed answer cut by an engine failure mid-body reached the client as a complete,
    well-terminated 200 with truncated JSON. Now: nothing sent yet -> a 502 in the API's shape;
    part of it sent -> the connection is cut without the terminating chunk."""
    with fake_engine("--model", MODEL, "--cut-after-bytes", str(cut)) as url:
        cfg = config(url)
        del cfg["auth"]
        with ServedGateway(cfg) as g:
            wait_ready(g.url)
            msgs = {"model": MODEL, "max_tokens": 2, "messages": [{"role": "user", "content": "hi"}]}
            for path, body in (("/v1/chat/completions", chat("hi")), ("/v1/messages", msgs)):
                if cut == 0:
                    r = httpx.post(g.url + path, json=body, timeout=30)
                    assert r.status_code == 502, r.text
                    if path == "/v1/messages":
                        assert r.json()["type"] == "error" and r.json()["error"]["type"] == "api_error"
                    else:
                        assert r.json()["error"]["code"] == "upstream_error"
                    assert r.headers["x-agentgw-engine"] == "e0"
                else:
                    with pytest.raises(httpx.RemoteProtocolError):
                        httpx.post(g.url + path, json=body, timeout=30)
                wait_ready(g.url)  # the failure ejected the engine until its next probe
            metrics = httpx.get(g.url + "/metrics", timeout=10).text
            for route in ("/v1/chat/completions", "/v1/messages"):
                assert f'engine="e0",pool="any",route="{route}",status="502"}} 1.0' in metrics


# -- bad input -------------------------------------------------------------------------------------
DEEP_BODIES = {
    "/v1/chat/completions": '{"model":"m","messages":[{"role":"user","content":"hi","x":%s}],"max_tokens":2}',
    "/v1/completions": '{"model":"m","prompt":"hi","max_tokens":2,"x":%s}',
    "/v1/messages": '{"model":"m","max_tokens":2,"messages":[{"role":"user","content":"hi"}],"metadata":{"x":%s}}',
    "/v1/responses": '{"model":"m","input":"hi","x":%s}',
}


@pytest.mark.parametrize("depth", [300, 1000])
def test_deeply_nested_json_is_forwarded_or_refused_in_the_apis_shape(gw: ServedGateway, depth: int) -> None:
    """Nesting between 255 and 1,024 levels gave a text/plain 500 on all four APIs (orjson writes
    255 levels, parses 1,024) once the body had to be re-serialised (a tenant's cache salt)."""
    nested = "[" * depth + "]" * depth
    for path, body in DEEP_BODIES.items():
        r = httpx.post(
            gw.url + path,
            content=(body % nested).encode(),
            headers={**hdr(ACME), "content-type": "application/json"},
            timeout=30,
        )
        assert r.headers["content-type"].startswith("application/json"), (path, r.text[:200])
        if depth == 300:
            assert r.status_code == 200, (path, r.text[:200])
        else:
            assert r.status_code == 400, (path, r.text[:200])
            err = r.json()["error"]
            assert "nests JSON too deeply" in err["message"], err
    metrics = httpx.get(gw.url + "/metrics", headers=hdr(ADMIN), timeout=10).text
    assert 'route="/v1/responses",status="500"' not in metrics


def exchange(g: ServedGateway, data: bytes) -> tuple[int, dict[str, str], bytes]:
    s = opened(g, data)
    try:
        return answer(s)
    finally:
        s.close()


@pytest.mark.parametrize(
    ("request_bytes", "status", "code"),
    [
        (b"GET /health HTTP/1.1\r\nHost: x\r\nx-a: a\x00b\r\n\r\n", 400, "invalid_http_request"),
        (b"GET /health HTTP/1.1\r\nHost: x\r\nx-a: a\x7fb\r\n\r\n", 400, "invalid_http_request"),
        (b"GET /health HTTP/1.1\r\nHost: x\r\nx-a: a\r\n  folded\r\n\r\n", 400, "invalid_http_request"),
        (
            b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\ncontent-length: abc\r\n\r\n",
            400,
            "invalid_http_request",
        ),
        (
            b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\ncontent-length: -1\r\n\r\n",
            400,
            "invalid_http_request",
        ),
        (
            b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\ncontent-length: 2\r\ncontent-length: 3\r\n\r\n{}",
            400,
            "invalid_http_request",
        ),
        (b"FOO /health HTTP/1.1\r\nHost: x\r\n\r\n", 501, "method_not_implemented"),
        (b"CONNECT example.com:443 HTTP/1.1\r\nHost: example.com\r\n\r\n", 501, "method_not_implemented"),
        (b"PROPFIND /health HTTP/1.1\r\nHost: x\r\n\r\n", 405, None),
        (b"PUT /health HTTP/1.1\r\nHost: x\r\ncontent-length: 0\r\n\r\n", 405, None),
        (b"PROPFIND /v1/chat/completions HTTP/1.1\r\nHost: x\r\n\r\n", 405, None),
        (b"GET /v1/messages HTTP/1.1\r\nHost: x\r\n\r\n", 405, None),
    ],
)
def test_malformed_http_gets_the_json_error_shape(
    gw: ServedGateway, request_bytes: bytes, status: int, code: str | None
) -> None:
    """Malformed requests got the server's text/plain 400, an unknown method a 400 (501 is right)."""
    got, hdrs, body = exchange(gw, request_bytes)
    assert got == status, body
    assert hdrs["content-type"] == "application/json"
    err = orjson.loads(body)["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["code"] == code
    if status == 405:
        assert hdrs["allow"]


def test_header_bytes_are_limited_when_the_whole_head_arrives_at_once(gw: ServedGateway) -> None:
    """``server.max_header_bytes`` (32 KiB here) was only checked between reads: 96 KB of headers
    arriving in one read passed to the engine."""
    many = b"".join(b"x-h%d: %s\r\n" % (i, b"v" * 3000) for i in range(32))  # ~96 KB, 32 headers
    got, _, body = exchange(gw, b"GET /health HTTP/1.1\r\nHost: x\r\n" + many + b"\r\n")
    assert (got, orjson.loads(body)["error"]["code"]) == (431, "headers_too_large")
    fine = b"".join(b"x-h%d: %s\r\n" % (i, b"v" * 500) for i in range(30))  # 15 KB
    got, _, _ = exchange(gw, b"GET /health HTTP/1.1\r\nHost: x\r\n" + fine + b"\r\n")
    assert got == 200


# -- stored responses and sessions: each tenant's own ---------------------------------------------
RESP = "sk-response-4"


@pytest.fixture(scope="module")
def quota_gw(engine_url: str) -> Iterator[ServedGateway]:
    cfg = config(engine_url, sessions={"capacity": 30})
    cfg["auth"]["tenants"] = [
        {"name": "acme", "key_sha256": [key_digest(ACME)], "max_sessions": 10},
        {"name": "beta", "key_sha256": [key_digest(BETA)], "max_sessions": 10},
        {"name": "response", "key_sha256": [key_digest(RESP)], "max_sessions": 10},
    ]
    with ServedGateway(cfg) as g:
        wait_ready(g.url)
        yield g


def respond(g: ServedGateway, key: str, **kw: Any) -> httpx.Response:
    body = {"model": MODEL, "input": "hi", "max_output_tokens": 2, **kw}
    return httpx.post(g.url + "/v1/responses", json=body, headers=hdr(key), timeout=30)


def test_one_tenants_stored_responses_never_evict_anothers(quota_gw: ServedGateway) -> None:
    """Response-owner records sat outside every tenant's quota: acme's stored responses evicted
    beta's, whose ``previous_response_id`` then got a 400."""
    r = respond(quota_gw, BETA)
    assert r.status_code == 200, r.text
    beta_id = r.json()["id"]
    for _ in range(40):
        assert respond(quota_gw, ACME).status_code == 200
    r = respond(quota_gw, BETA, previous_response_id=beta_id)
    assert r.status_code == 200, r.text


def test_a_tenant_named_response_cannot_reach_other_tenants_response_routing(quota_gw: ServedGateway) -> None:
    """Owner records were keyed ``response:<tenant>:<id>``: the session ``<tenant>:<id>`` of a
    tenant named ``response`` was the same key, so it could read and delete them."""
    r = respond(quota_gw, ACME)
    acme_id = r.json()["id"]
    with httpx.Client(base_url=quota_gw.url, headers=hdr(RESP), timeout=30) as c:
        assert c.get(f"/v1/agent/sessions/acme:{acme_id}").status_code == 404
        assert c.delete(f"/v1/agent/sessions/acme:{acme_id}").status_code == 404
    assert respond(quota_gw, ACME, previous_response_id=acme_id).status_code == 200
    # the dashboard lists sessions, not the stored responses' engines
    state = httpx.get(quota_gw.url + "/dashboard/state", headers=hdr(ADMIN), timeout=30).json()
    assert not any(acme_id in str(s) for s in state["sessions"]["items"]), state["sessions"]


def test_errors_name_the_callers_ids_not_the_gateways(quota_gw: ServedGateway) -> None:
    r = respond(quota_gw, BETA, previous_response_id="resp_nothere")
    assert r.status_code in (400, 404), r.text
    assert "'resp_nothere'" in r.text and "beta:" not in r.text


def test_the_session_api_namespaces_a_parent_hint(quota_gw: ServedGateway) -> None:
    """``parent_session_id`` from the session API was stored as sent: a tenant could name another
    tenant's session (its stored id) as its parent."""
    with httpx.Client(base_url=quota_gw.url, timeout=30) as c:
        r = c.post(
            "/v1/agent/sessions/kid/hints", json={"parent_session_id": "beta:theirs"}, headers=hdr(ACME)
        )
        assert r.status_code == 200, r.text
        assert r.json()["parent_session_id"] == "beta:theirs"  # acme's own id of that name
        stored = c.get("/v1/agent/sessions/acme:kid", headers=hdr(ADMIN)).json()
        assert stored["parent_session_id"] == "acme:beta:theirs"


@pytest.mark.parametrize(
    ("method", "path"),
    [
        ("DELETE", "/v1/responses/resp_1"),
        ("GET", "/v1/responses/resp_1/input_items"),
        ("GET", "/v1/responses/b@d"),
        ("GET", "/v1/agent/sessions/" + "s" * 300),
    ],
)
def test_response_routes_authenticate_first(quota_gw: ServedGateway, method: str, path: str) -> None:
    r = httpx.request(method, quota_gw.url + path, timeout=30)
    assert r.status_code == 401, r.text
    r = httpx.request(method, quota_gw.url + path, headers=hdr(ACME), timeout=30)
    assert r.status_code in (400, 501), r.text


# -- what reaches an engine ------------------------------------------------------------------------
@pytest.mark.parametrize("keys", [True, False])
def test_engine_steering_fields_and_foreign_headers_never_reach_an_engine(keys: bool) -> None:
    """A client's own ``priority``, ``cache_salt``, ``kv_transfer_params`` (``remote_host``,
    ``do_remote_prefill``: steering the engine's KV connector), ``vllm_xargs.kv_transfer_params``
    and ``ec_transfer_params`` reached the engines, and so did hop-by-hop and credential headers
    (``Connection``-nominated ones, ``Proxy-Authorization``, ``Cookie``)."""
    rec = RecordingEngine()
    try:
        cfg = config(rec.url)
        if not keys:
            del cfg["auth"]
        with ServedGateway(cfg) as g:
            wait_ready(g.url)
            body = chat(
                "hi",
                priority=-100,
                cache_salt="someone-elses",
                kv_transfer_params={"remote_host": "10.0.0.9", "do_remote_prefill": True, "agentgw": {}},
                ec_transfer_params={"x": 1},
                vllm_xargs={"kv_transfer_params": {"remote_host": "10.0.0.9"}, "keep": 1},
            )
            headers = {
                "connection": "keep-alive, x-secret-hop",
                "x-secret-hop": "1",
                "proxy-authorization": "Basic c2VjcmV0",
                "cookie": "session=secret",
                "x-data-parallel-rank": "3",
                "x-request-id": "req-42",
                "traceparent": "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01",
                **(hdr(ACME) if keys else {}),
            }
            r = httpx.post(g.url + "/v1/chat/completions", json=body, headers=headers, timeout=30)
            assert r.status_code == 200, r.text
    finally:
        rec.close()
    ((_, sent_headers, sent),) = rec.seen
    assert "priority" not in sent and "ec_transfer_params" not in sent and "kv_transfer_params" not in sent
    assert sent["vllm_xargs"] == {"keep": 1}
    if keys:
        assert sent["cache_salt"] == g.service.tenants.tenants["acme"].cache_salt
    else:
        assert "cache_salt" not in sent
    for name in ("x-secret-hop", "proxy-authorization", "cookie", "authorization", "x-data-parallel-rank"):
        assert name not in sent_headers, name
    assert sent_headers["x-request-id"] == "req-42" and sent_headers["traceparent"].startswith("00-")


def test_utf8_hint_headers_are_read_as_utf8(gw: ServedGateway) -> None:
    """A UTF-8 session id in a hint header was read byte by byte (latin-1) and refused as
    "not printable"."""
    sid = "sessión-ü"
    r = httpx.post(
        gw.url + "/v1/chat/completions",
        json=chat("hi"),
        headers=[(b"authorization", f"Bearer {ACME}".encode()), (b"x-session-id", sid.encode())],
        timeout=30,
    )
    assert r.status_code == 200, r.text
    assert dict(r.headers.raw)[b"x-agentgw-session"].decode() == sid


def test_no_unauthenticated_api_docs_and_the_dashboard_sends_security_headers(gw: ServedGateway) -> None:
    with httpx.Client(base_url=gw.url, timeout=30) as c:
        for path in ("/docs", "/redoc", "/openapi.json"):  # served without a key before
            assert c.get(path).status_code == 404, path
        for path, key in (
            ("/dashboard", None),
            ("/dashboard/static/dashboard.js", None),
            ("/dashboard/state", ADMIN),
        ):
            r = c.get(path, headers=hdr(key) if key else {})
            assert r.status_code == 200, path
            csp = r.headers["content-security-policy"]
            assert "default-src 'self'" in csp and "frame-ancestors 'none'" in csp, path
            assert r.headers["x-frame-options"] == "DENY" and r.headers["x-content-type-options"] == "nosniff"
