"""Hostile clients against a real gateway on loopback (uvicorn with the server limits, a stand-in
engine): header count and size, slow headers and bodies, idle keep-alive, the connection cap,
body limits on the session API and the dry run, the admin guard and per-tenant sessions."""

from __future__ import annotations

import socket
from collections.abc import Iterator
from typing import Any

import httpx
import orjson
import pytest

from gateway.api.errors import reshape_upstream_error
from gateway.service.tenants import key_digest
from tests.conftest import ServedGateway, fake_engine, wait_ready

ACME, BETA, ADMIN = "sk-acme-1", "sk-beta-2", "sk-admin-3"


@pytest.fixture(scope="module")
def engine_url() -> Iterator[str]:
    with fake_engine("--model", "m") as url:
        yield url


def base(engine_url: str, **kw: Any) -> dict[str, Any]:
    return {
        "pools": [
            {"name": "any", "role": "any", "engines": [{"name": "e0", "url": engine_url, "model": "m"}]}
        ],
        **kw,
    }


@pytest.fixture(scope="module")
def gw(engine_url: str) -> Iterator[ServedGateway]:
    """Short timeouts, keys required."""
    cfg = base(
        engine_url,
        server={
            "header_timeout_s": 1.0,
            "body_timeout_s": 1.0,
            "keep_alive_s": 1.0,
            "max_header_count": 40,
            "max_header_bytes": 32768,
        },
        limits={"max_body_bytes": 100_000, "max_session_body_bytes": 4096},
        auth={
            "tenants": [
                {"name": "acme", "key_sha256": [key_digest(ACME)], "models": ["other"]},
                {"name": "beta", "key_sha256": [key_digest(BETA)]},
            ],
            "admin_key_sha256": [key_digest(ADMIN)],
        },
    )
    with ServedGateway(cfg) as g:
        wait_ready(g.url)
        yield g


def addr(g: ServedGateway) -> tuple[str, int]:
    return ("127.0.0.1", g.config.listen.port)


def exchange(g: ServedGateway, data: bytes = b"", chunk: int = 65536) -> bytes:
    """Send ``data`` (stopping if the server closes), then read until the server closes."""
    with socket.create_connection(addr(g), timeout=30) as s:
        try:
            for i in range(0, len(data), chunk):
                s.sendall(data[i : i + chunk])
        except (BrokenPipeError, ConnectionResetError):
            pass
        out = b""
        try:
            while part := s.recv(65536):
                out += part
        except ConnectionResetError:
            pass
        return out


def status_and_error(raw: bytes) -> tuple[int, dict[str, Any]]:
    head, _, body = raw.partition(b"\r\n\r\n")
    status = int(head.split(b" ", 2)[1])
    err = orjson.loads(body)["error"]
    assert set(err) == {"message", "type", "param", "code"}
    return status, err


def test_too_many_headers_is_431(gw: ServedGateway) -> None:
    req = b"GET /health HTTP/1.1\r\nHost: x\r\n" + b"".join(b"x-h%d: v\r\n" % i for i in range(100)) + b"\r\n"
    status, err = status_and_error(exchange(gw, req))
    assert (status, err["code"]) == (431, "too_many_headers")


def test_a_one_megabyte_header_is_cut_at_the_limit(gw: ServedGateway) -> None:
    req = b"GET /health HTTP/1.1\r\nHost: x\r\nx-big: " + b"a" * (1 << 20) + b"\r\n\r\n"
    status, err = status_and_error(exchange(gw, req))
    assert (status, err["code"]) == (431, "headers_too_large")


def test_a_long_request_line_is_414(gw: ServedGateway) -> None:
    req = b"GET /health?" + b"q" * 100_000 + b" HTTP/1.1\r\nHost: x\r\n\r\n"
    status, err = status_and_error(exchange(gw, req))
    assert (status, err["code"]) == (414, "url_too_long")


def test_slowloris_headers_and_silent_connections_get_408(gw: ServedGateway) -> None:
    status, err = status_and_error(exchange(gw, b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\n"))
    assert (status, err["code"]) == (408, "header_timeout")
    status, err = status_and_error(exchange(gw))  # connects and says nothing
    assert (status, err["code"]) == (408, "header_timeout")


def test_slow_body_gets_408(gw: ServedGateway) -> None:
    req = (
        b"POST /v1/agent/sessions/s/hints HTTP/1.1\r\nHost: x\r\n"
        + f"authorization: Bearer {ADMIN}\r\n".encode()
        + b'content-type: application/json\r\ncontent-length: 1000\r\n\r\n{"fan_out":'
    )
    status, err = status_and_error(exchange(gw, req))
    assert (status, err["code"]) == (408, "body_timeout")


def test_idle_keep_alive_connection_is_closed(gw: ServedGateway) -> None:
    with socket.create_connection(addr(gw), timeout=30) as s:
        s.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
        first = s.recv(65536)
        assert first.startswith(b"HTTP/1.1 200")
        rest = b""
        while part := s.recv(65536):  # returns b"" once the server closes the idle connection
            rest += part
        assert rest == b""


def test_connection_cap(engine_url: str) -> None:
    """Past the cap, a small reserve answers liveness and readiness probes only (a socket flood
    failed /health before); past the reserve, a 503 at once."""
    cfg = base(engine_url, server={"max_connections": 4, "keep_alive_s": 60, "probe_reserve": 2})
    with ServedGateway(cfg) as g:
        wait_ready(g.url)
        held = []
        try:
            for _ in range(4):  # 4 live keep-alive connections, each seen by the server
                s = socket.create_connection(addr(g), timeout=30)
                s.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
                assert s.recv(65536).startswith(b"HTTP/1.1 200")
                held.append(s)
            for probe in (b"/health", b"/ready"):  # the reserve: answered, then closed
                raw = exchange(g, b"GET " + probe + b" HTTP/1.1\r\nHost: x\r\n\r\n")
                assert raw.startswith(b"HTTP/1.1 200") and b"connection: close" in raw.lower(), raw[:200]
            status, err = status_and_error(exchange(g, b"GET /v1/models HTTP/1.1\r\nHost: x\r\n\r\n"))
            assert (status, err["code"]) == (503, "too_many_connections")  # only probes there
            for _ in range(2):  # the reserve taken by idle sockets
                s = socket.create_connection(addr(g), timeout=30)
                held.append(s)
            status, err = status_and_error(exchange(g, b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n"))
            assert (status, err["code"]) == (503, "too_many_connections")
        finally:
            for s in held:
                s.close()
        ok = False
        for _ in range(50):  # bounded: the server notices the closed sockets
            raw = exchange(g, b"GET /health HTTP/1.1\r\nHost: x\r\nconnection: close\r\n\r\n")
            if raw.startswith(b"HTTP/1.1 200"):
                ok = True
                break
        assert ok


def hdr(key: str) -> dict[str, str]:
    return {"authorization": f"Bearer {key}"}


def test_body_limits_on_the_session_api_and_the_dry_run(gw: ServedGateway) -> None:
    with httpx.Client(base_url=gw.url, timeout=30) as c:
        big = b'{"x": "' + b"a" * 10_000 + b'"}'
        r = c.post("/v1/agent/sessions/s/hints", content=big, headers=hdr(BETA))
        assert (r.status_code, r.json()["error"]["code"]) == (413, "body_too_large")

        def chunks() -> Iterator[bytes]:  # no content-length: counted as it streams in
            for _ in range(100):
                yield b"a" * 2000

        r = c.post("/v1/agent/sessions/s/hints", content=chunks(), headers=hdr(BETA))
        assert r.status_code == 413
        r = c.post("/debug/route", content=b"[" + b"1," * 100_000 + b"1]", headers=hdr(ADMIN))
        assert (r.status_code, r.json()["error"]["code"]) == (413, "body_too_large")
        long_id = "s" * 10_000
        r = c.post(f"/v1/agent/sessions/{long_id}/hints", json={"fan_out": 1}, headers=hdr(BETA))
        assert (r.status_code, r.json()["error"]["param"]) == (400, "session_id")


def test_admin_guard(gw: ServedGateway) -> None:
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
    with httpx.Client(base_url=gw.url, timeout=30) as c:
        for path, call in (
            ("/metrics", lambda h: c.get("/metrics", headers=h)),
            ("/debug/route", lambda h: c.post("/debug/route", json=body, headers=h)),
        ):
            assert call({}).status_code == 401, path
            assert call(hdr("sk-wrong")).status_code == 401, path
            r = call(hdr(BETA))
            assert (r.status_code, r.json()["error"]["code"]) == (403, "admin_required"), path
            assert call(hdr(ADMIN)).status_code == 200, path
            assert call({"x-api-key": ADMIN}).status_code == 200, path
        assert c.get("/health").status_code == 200 and c.get("/ready").status_code == 200
        assert c.get("/v1/models").status_code == 401
        assert [m["id"] for m in c.get("/v1/models", headers=hdr(BETA)).json()["data"]] == ["m"]
        assert c.get("/v1/models", headers=hdr(ACME)).json()["data"] == []  # acme may use 'other' only


def test_a_key_reaches_only_its_own_tenants_sessions(gw: ServedGateway) -> None:
    with httpx.Client(base_url=gw.url, timeout=30) as c:
        sid = "alice@example.com"
        r = c.post(
            f"/v1/agent/sessions/{sid}/hints", json={"expected_tool_latency_ms": 4000}, headers=hdr(ACME)
        )
        assert r.status_code == 200 and r.json()["id"] == sid
        assert c.get(f"/v1/agent/sessions/{sid}", headers=hdr(BETA)).status_code == 404
        assert c.delete(f"/v1/agent/sessions/{sid}", headers={"x-api-key": BETA}).status_code == 404
        r = c.post(f"/v1/agent/sessions/{sid}/hints", json={"session_end": True}, headers=hdr(BETA))
        assert r.json()["existed"] is False
        assert c.get(f"/v1/agent/sessions/{sid}", headers={"x-api-key": ACME}).json()["expected_gap_s"] == 4.0
        assert c.get(f"/v1/agent/sessions/acme:{sid}", headers=hdr(ADMIN)).status_code == 200
        assert c.get(f"/v1/agent/sessions/{sid}").status_code == 401
        assert c.delete(f"/v1/agent/sessions/{sid}", headers=hdr(ACME)).status_code == 200


def test_reshape_upstream_error_bodies() -> None:
    def shaped(status: int, body: bytes) -> dict[str, Any]:
        err = orjson.loads(reshape_upstream_error(status, body))["error"]
        assert set(err) == {"message", "type", "param", "code"}
        return err

    # vLLM's OpenAI-like shape, its exception class as the type and the status as the code: the
    # gateway's type and a string code, the message kept
    vllm = orjson.dumps({"error": {"message": "m", "type": "BadRequestError", "param": None, "code": 400}})
    assert shaped(400, vllm) == {
        "message": "m",
        "type": "invalid_request_error",
        "param": None,
        "code": "upstream_error",
    }
    own = {"message": "too long", "type": "invalid_request_error", "param": "input", "code": "too_long"}
    assert shaped(400, orjson.dumps({"error": own})) == own
    err = shaped(400, b'{"detail": "max_tokens must be at least 1"}')
    assert (err["message"], err["type"], err["code"]) == (
        "max_tokens must be at least 1",
        "invalid_request_error",
        "upstream_error",
    )
    err = shaped(
        422,
        orjson.dumps(
            {"detail": [{"loc": ["body", "messages", 0], "msg": "Field required", "type": "missing"}]}
        ),
    )
    assert (err["param"], err["message"]) == ("messages.0", "messages.0: Field required")
    assert shaped(404, b'{"message": "no such model"}')["message"] == "no such model"
    assert shaped(500, b'{"error": "boom"}')["message"] == "boom"
    assert shaped(502, b"<html>bad gateway</html>")["message"] == "<html>bad gateway</html>"
    assert shaped(503, b"")["message"] == "engine answered 503"
    assert shaped(400, b"\xff\xfe")["message"]
    assert shaped(400, b"[1, 2]")["message"] == "[1,2]"
    assert len(shaped(400, b'{"detail": "' + b"x" * 10_000 + b'"}')["message"]) == 2003


def test_connection_cap_never_exceeds_half_the_descriptor_limit() -> None:
    import resource

    from gateway.api.server import connection_cap

    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    half = 10**9 if soft == resource.RLIM_INFINITY else max(64, soft // 2)
    assert connection_cap(10) == min(10, half)
    assert connection_cap(10**9) == half
