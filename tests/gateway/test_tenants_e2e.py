"""Tenants, admission and a dying engine through a served gateway, on the hot path of every wire
API, against the stand-in engine (real processes on loopback): keys pick tenants, ids are
namespaced (one tenant cannot read another's session even by its id), limits answer 429 with
Retry-After in the API's own shape, and a stream whose engine is killed mid-response ends with an
explicit error event."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

import httpx
import orjson
import pytest

from gateway.service.tenants import key_digest
from testing.net import free_port, wait_http_ok
from tests.conftest import ServedGateway, fake_engine, wait_ready

MODEL = "m"
ACME, BETA, ADMIN = "sk-acme-1", "sk-beta-2", "sk-admin-3"


def _config(url: str, **auth: object) -> dict[str, object]:
    return {
        "pools": [{"name": "p", "role": "any", "engines": [{"name": "e0", "url": url, "model": MODEL}]}],
        "auth": {
            "tenants": [
                {"name": "acme", "key_sha256": [key_digest(ACME)], "max_concurrent": 1},
                {"name": "beta", "key_sha256": [key_digest(BETA)], "models": ["other"]},
            ],
            "admin_key_sha256": [key_digest(ADMIN)],
            **auth,
        },
        "timeouts": {"health_interval_s": 0.5, "metrics_interval_s": 0.5},
    }


def _h(key: str, **extra: str) -> dict[str, str]:
    return {"authorization": f"Bearer {key}", **extra}


CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}


@pytest.fixture(scope="module")
def paced() -> Iterator[str]:
    with fake_engine("--model", MODEL, "--tokens", "40", "--itl-ms", "50") as url:
        yield url


def test_keys_tenants_and_namespaced_sessions(paced: str) -> None:
    with ServedGateway(_config(paced)) as gw, httpx.Client(base_url=gw.url, timeout=30) as c:
        wait_ready(gw.url)
        r = c.post("/v1/chat/completions", json=CHAT)
        assert r.status_code == 401 and r.json()["error"]["code"] == "missing_api_key"
        r = c.post(
            "/v1/messages",
            json={"model": MODEL, "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}]},
        )
        assert r.status_code == 401 and r.json()["type"] == "error"  # Anthropic's shape
        assert r.json()["error"]["type"] == "authentication_error"
        r = c.post("/v1/chat/completions", json=CHAT, headers=_h(ACME, **{"x-agent-session-id": "s1"}))
        assert r.status_code == 200, r.text
        assert r.headers["x-agentgw-session"] == "s1"  # the tenant's own id, not the stored one
        # the same id from another tenant is another session; nobody reads acme's without its key
        assert c.get("/v1/agent/sessions/s1", headers=_h(ACME)).status_code == 200
        assert c.get("/v1/agent/sessions/s1", headers=_h(BETA)).status_code == 404
        assert c.get("/v1/agent/sessions/acme:s1", headers=_h(BETA)).status_code in (400, 404)
        assert c.get("/v1/agent/sessions/acme:s1", headers=_h(ADMIN)).status_code == 200
        # beta may not use the model
        r = c.post("/v1/chat/completions", json=CHAT, headers=_h(BETA))
        assert r.status_code == 403 and r.json()["error"]["param"] == "model"
        # admin routes want the admin key
        assert c.get("/metrics", headers=_h(ACME)).status_code == 403
        assert c.get("/metrics", headers=_h(ADMIN)).status_code == 200


def test_a_tenants_concurrency_limit_is_a_429_with_retry_after(paced: str) -> None:
    with ServedGateway(_config(paced)) as gw:
        wait_ready(gw.url)
        got: list[int] = []
        started = threading.Event()

        def slow() -> None:
            with httpx.stream(
                "POST",
                gw.url + "/v1/chat/completions",
                json=CHAT | {"stream": True, "max_tokens": 40},
                headers=_h(ACME),
                timeout=30,
            ) as s:
                started.set()
                got.append(s.status_code)
                for _ in s.iter_bytes():
                    pass

        t = threading.Thread(target=slow)
        t.start()
        assert started.wait(10)
        r = httpx.post(gw.url + "/v1/chat/completions", json=CHAT, headers=_h(ACME), timeout=30)
        t.join(30)
        assert got == [200]
        assert r.status_code == 429, r.text
        assert r.json()["error"]["code"] == "tenant_concurrency" and "retry-after" in r.headers
        # the slot is back once the stream ended
        assert (
            httpx.post(gw.url + "/v1/chat/completions", json=CHAT, headers=_h(ACME), timeout=30).status_code
            == 200
        )


@contextlib.contextmanager
def _killable_engine() -> Iterator[tuple[str, subprocess.Popen[bytes]]]:
    port = free_port()
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "testing.fake_engine",
            "--port",
            str(port),
            "--model",
            MODEL,
            "--tokens",
            "200",
            "--itl-ms",
            "20",
        ],
        cwd=Path(__file__).resolve().parents[2],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    url = f"http://127.0.0.1:{port}"
    try:
        wait_http_ok(url + "/health", 10, proc)
        yield url, proc
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait(5)


def test_an_engine_killed_mid_stream_ends_the_stream_with_an_error_event() -> None:
    with (
        _killable_engine() as (url, proc),
        ServedGateway(_config(url, tenants=[], admin_key_sha256=[])) as gw,
    ):
        wait_ready(gw.url)
        lines: list[str] = []
        with httpx.stream(
            "POST",
            gw.url + "/v1/chat/completions",
            json=CHAT | {"stream": True, "max_tokens": 200},
            timeout=30,
        ) as s:
            assert s.status_code == 200
            for line in s.iter_lines():
                lines.append(line)
                if len(lines) == 6:
                    os.kill(proc.pid, signal.SIGKILL)  # the engine dies mid-response
        data = [ln[6:] for ln in lines if ln.startswith("data: ")]
        assert data[-1] == "[DONE]"
        err = orjson.loads(data[-2])
        assert err["error"]["code"] == "upstream_error", data[-3:]
        assert 'agentgw_upstream_errors_total{engine="e0"' in httpx.get(gw.url + "/metrics").text


def test_a_frozen_engine_ends_its_streams_and_its_new_requests_go_elsewhere() -> None:
    with _killable_engine() as (u0, p0), _killable_engine() as (u1, p1):
        cfg = _config(u0, tenants=[], admin_key_sha256=[])
        cfg["pools"] = [
            {
                "name": "p",
                "role": "any",
                "engines": [
                    {"name": "e0", "url": u0, "model": MODEL},
                    {"name": "e1", "url": u1, "model": MODEL},
                ],
            }
        ]
        cfg["routing"] = {"profile": "round_robin"}
        cfg["timeouts"] = {"health_interval_s": 60, "first_byte_s": 1, "inter_chunk_s": 1}
        procs = {"e0": p0, "e1": p1}
        with ServedGateway(cfg) as gw:
            wait_ready(gw.url)
            frozen = None
            lines: list[str] = []
            body = CHAT | {"stream": True, "max_tokens": 200}
            try:
                with httpx.stream("POST", gw.url + "/v1/chat/completions", json=body, timeout=30) as s:
                    frozen = s.headers["x-agentgw-engine"]
                    for line in s.iter_lines():
                        lines.append(line)
                        if len(lines) == 6:
                            os.kill(procs[frozen].pid, signal.SIGSTOP)  # alive, but silent
                data = [ln[6:] for ln in lines if ln.startswith("data: ")]
                assert data[-1] == "[DONE]" and "error" in orjson.loads(data[-2]), data[-3:]
                # new requests: whichever is sent to the frozen engine times out waiting for its
                # headers and is retried on the other one; none fails
                for _ in range(3):
                    r = httpx.post(gw.url + "/v1/chat/completions", json=CHAT, timeout=30)
                    assert r.status_code == 200, r.text
                    assert r.headers["x-agentgw-engine"] != frozen
            finally:
                if frozen is not None:
                    os.kill(procs[frozen].pid, signal.SIGCONT)
