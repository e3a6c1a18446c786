"""The control server over a real loopback socket, with an in-memory policy standing in."""

from __future__ import annotations

import json
import socket
import threading
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from engine_ext.config import (
    CONTROL_TOKEN_ENV,
    control_env,
    control_token,
    kv_transfer_config,
    write_token_file,
)
from engine_ext.control import ControlServer, ControlService

TOKEN = "s3cret"


class FakePolicy:
    def __init__(self) -> None:
        self.pins: dict[str, float] = {}

    def pin_session(self, session_id: str, ttl_s: float) -> int:
        self.pins[session_id] = ttl_s
        return 3

    def unpin_session(self, session_id: str) -> bool:
        return self.pins.pop(session_id, None) is not None

    def demote_session(self, session_id: str) -> int:
        self.pins.pop(session_id, None)
        return 3

    def session_state(self, session_id: str) -> dict[str, Any]:
        return {"host_chunks": 3, "known_chunks": 3, "pin": self.pins.get(session_id)}


@pytest.fixture
def server() -> Iterator[str]:
    srv = ControlServer(
        ControlService(FakePolicy(), lambda: {"host": {}, "tiers": {}}), "127.0.0.1", 0, TOKEN
    )
    srv.start()
    try:
        yield f"http://127.0.0.1:{srv.port}"
    finally:
        srv.stop()


def call(url: str, method: str, path: str, token: str | None = TOKEN, **body: Any) -> httpx.Response:
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    return httpx.request(method, url + path, json=body or None, headers=headers, timeout=10)


@pytest.mark.parametrize("token", [None, "wrong"])
def test_requests_without_the_shared_token_are_refused(server: str, token: str | None) -> None:
    r = call(server, "GET", "/v1/kv/stats", token=token)
    assert r.status_code == 401 and r.json()["error"]["type"] == "unauthorized"


@pytest.mark.parametrize(
    ("path", "body", "status"),
    [
        ("/v1/kv/pin", {"session_id": "s"}, 400),
        ("/v1/kv/pin", {"session_id": "s", "ttl_s": -1}, 400),
        ("/v1/kv/unpin", {}, 400),
        ("/v1/kv/prefetch", {"token_ids": []}, 400),
        ("/v1/kv/prefetch", {"token_ids": [1, 2], "pin_ttl_s": 3}, 400),
        ("/v1/kv/prefetch", {"token_ids": [1, 2]}, 501),  # no engine_url configured
        ("/v1/kv/nothing", {"session_id": "s"}, 404),
    ],
)
def test_bad_requests_get_precise_errors(server: str, path: str, body: dict[str, Any], status: int) -> None:
    r = call(server, "POST", path, **body)
    assert r.status_code == status
    assert r.json()["error"]["code"] == status


def test_pin_unpin_evict_are_idempotent(server: str) -> None:
    assert (
        call(server, "POST", "/v1/kv/pin", session_id="s", ttl_s=5).json()
        == call(server, "POST", "/v1/kv/pin", session_id="s", ttl_s=5).json()
    )
    assert call(server, "GET", "/v1/kv/sessions/s").json()["pin"] == 5
    assert call(server, "POST", "/v1/kv/unpin", session_id="s").json()["unpinned"] is True
    assert call(server, "POST", "/v1/kv/unpin", session_id="s").json()["unpinned"] is False
    assert call(server, "POST", "/v1/kv/evict", session_id="s").json()["demoted_chunks"] == 3


@pytest.mark.parametrize("token", ["", " padded "])
def test_the_control_api_never_runs_without_a_token(token: str) -> None:
    """An empty token matched a bare ``Authorization: Bearer``: the API was open to anyone who
    could reach the port. Now neither the server nor the engine's config can be built without one."""
    with pytest.raises(ValueError, match="control_token"):
        ControlServer(ControlService(FakePolicy(), lambda: {}), "127.0.0.1", 0, token)
    with pytest.raises(ValueError, match="control_token"):
        control_env(token)
    env = {CONTROL_TOKEN_ENV: token} if token else {}
    with pytest.raises(ValueError, match="control_token"):
        control_token(kv_transfer_config(1 << 20, control_port=1)["kv_connector_extra_config"], env)


# -- where the engine finds its token: never in its arguments (hostile round 4) -------------------
def test_the_engines_config_never_carries_the_token(tmp_path: Any) -> None:
    """The token was inside ``--kv-transfer-config``, so any local user read it from the engine's
    ``/proc/<pid>/cmdline``. Now the config names at most a file; the token comes from the
    environment or that file."""
    extra = kv_transfer_config(1 << 20, control_port=1)["kv_connector_extra_config"]
    assert "control_token" not in json.dumps(extra)
    assert control_token(extra, control_env("s3cret")) == "s3cret"
    path = write_token_file(tmp_path / "token", "from-file")
    assert path.stat().st_mode & 0o777 == 0o600
    extra = kv_transfer_config(1 << 20, control_port=1, control_token_file=path)["kv_connector_extra_config"]
    assert extra["control_token_file"] == str(path) and "from-file" not in json.dumps(extra)
    assert control_token(extra, {}) == "from-file"  # the file first, even with the environment set
    assert control_token(extra, control_env("other")) == "from-file"


@pytest.mark.parametrize("mode", [0o644, 0o640, 0o604, 0o660])
def test_a_token_file_other_users_can_read_is_refused(tmp_path: Any, mode: int) -> None:
    path = write_token_file(tmp_path / "token", "t")
    path.chmod(mode)
    with pytest.raises(ValueError, match="chmod 600"):
        control_token({"control_token_file": str(path)}, {})


def test_a_token_left_in_the_config_still_works_with_a_warning(caplog: pytest.LogCaptureFixture) -> None:
    """Configs written before the change keep starting their engines, and say what to change."""
    with caplog.at_level("WARNING", logger="engine_ext.config"):
        assert control_token({"control_token": "old"}, {}) == "old"
    assert CONTROL_TOKEN_ENV in caplog.text and "cmdline" in caplog.text


@pytest.mark.parametrize("auth", [b"Bearer", b"Bearer ", b"bearer  ", b""])
def test_a_bare_bearer_is_refused(server: str, auth: bytes) -> None:
    port = int(server.rsplit(":", 1)[1])
    head = b"GET /v1/kv/stats HTTP/1.1\r\nHost: x\r\n"
    if auth:
        head += b"Authorization: " + auth + b"\r\n"
    with socket.create_connection(("127.0.0.1", port), timeout=10) as s:
        s.sendall(head + b"Connection: close\r\n\r\n")
        answer = b""
        while part := s.recv(65536):
            answer += part
    assert answer.startswith(b"HTTP/1.1 401") or answer.startswith(b"HTTP/1.0 401"), answer[:80]


# -- the server's bounds (hostile probing: a thread per socket, tracebacks, endless bodies) -------
@pytest.fixture
def tight() -> Iterator[ControlServer]:
    srv = ControlServer(
        ControlService(FakePolicy(), lambda: {"host": {}, "tiers": {}}),
        "127.0.0.1",
        0,
        TOKEN,
        max_inflight=2,
        max_connections=16,
        header_timeout_s=1.0,
        body_timeout_s=1.0,
        keep_alive_s=1.0,
        max_body_bytes=4096,
    )
    srv.start()
    try:
        yield srv
    finally:
        srv.stop()


def raw_call(port: int, data: bytes) -> tuple[int, dict[str, Any]]:
    """Send ``data``, read until the server closes; the status and the JSON error."""
    with socket.create_connection(("127.0.0.1", port), timeout=30) as s:
        s.sendall(data)
        answer = b""
        while part := s.recv(65536):
            answer += part
    head, _, body = answer.partition(b"\r\n\r\n")
    return int(head.split()[1]), json.loads(body)


AUTH = f"Authorization: Bearer {TOKEN}\r\n".encode()


def test_idle_sockets_hold_no_thread_and_are_cut(tight: ControlServer) -> None:
    """1,000 idle sockets gave 1,002 threads (9 GB virtual) inside the engine: one thread per
    unauthenticated socket, with no timeout. Now a fixed set of threads, a connection cap (503
    past it) and a header timeout (408)."""
    before = threading.active_count()
    idle = [socket.create_connection(("127.0.0.1", tight.port), timeout=30) for _ in range(200)]
    try:
        assert threading.active_count() <= before + 2  # no thread per socket
        for s in idle:  # each gets its answer (503 past the cap, else 408), then the server closes
            answer = b""
            while part := s.recv(65536):
                answer += part
            assert answer.split()[1] in (b"503", b"408"), answer[:60]
    finally:
        for s in idle:
            s.close()
    assert tight.refused.get(503, 0) + tight.refused.get(408, 0) == 200
    assert tight.refused.get(503, 0) > 0 and tight.peak_connections == 16
    assert threading.active_count() <= before + 2
    r = call(f"http://127.0.0.1:{tight.port}", "GET", "/v1/kv/stats")  # the gateway's own call
    assert r.status_code == 200


@pytest.mark.parametrize(
    ("head", "status"),
    [
        (b"POST /v1/kv/pin HTTP/1.1\r\nHost: x\r\n" + AUTH + b"Content-Length: abc\r\n\r\n", 400),
        (b"POST /v1/kv/pin HTTP/1.1\r\nHost: x\r\n" + AUTH + b"Content-Length: -1\r\n\r\n", 400),
        (
            b"POST /v1/kv/pin HTTP/1.1\r\nHost: x\r\n"
            + AUTH
            + b"Content-Length: 5\r\nContent-Length: 6\r\n\r\n",
            400,
        ),
        (b"POST /v1/kv/pin HTTP/1.1\r\nHost: x\r\n" + AUTH + b"Content-Length: 99999\r\n\r\n", 413),
        (b"POST /v1/kv/pin HTTP/1.1\r\nHost: x\r\n" + AUTH + b"Transfer-Encoding: chunked\r\n\r\n", 501),
        (b"POST /v1/kv/pin HTTP/1.1\r\nHost: x\r\nContent-Length: -1\r\n\r\n", 401),  # auth first
        (b"GARBAGE\r\n\r\n", 400),
        (b"GET /v1/kv/stats HTTP/1.1\r\nx-a: " + b"a" * 20_000 + b"\r\n\r\n", 431),
        (b"PUT /v1/kv/pin HTTP/1.1\r\nHost: x\r\n" + AUTH + b"\r\n", 405),
    ],
)
def test_bad_heads_get_an_error_not_a_traceback(tight: ControlServer, head: bytes, status: int) -> None:
    """``Content-Length: abc`` dropped the connection with a traceback; ``-1`` read forever."""
    got, body = raw_call(tight.port, head)
    assert got == status and body["error"]["code"] == status


def test_endless_bodies_are_cut_and_never_hold_the_operation_slots(tight: ControlServer) -> None:
    """Eight requests with endless bodies took every slot: the gateway's own calls got 429."""
    slow = []
    for _ in range(6):  # more than max_inflight
        s = socket.create_connection(("127.0.0.1", tight.port), timeout=30)
        s.sendall(b"POST /v1/kv/pin HTTP/1.1\r\nHost: x\r\n" + AUTH + b"Content-Length: 4000\r\n\r\n{")
        slow.append(s)
    try:
        for _ in range(100):
            if tight.connections >= 6:
                break
            time.sleep(0.02)
        r = call(f"http://127.0.0.1:{tight.port}", "POST", "/v1/kv/pin", session_id="s", ttl_s=5)
        assert r.status_code == 200, r.text  # the slots are free while the bodies trickle
        for s in slow:
            answer = b""
            while part := s.recv(65536):
                answer += part
            assert answer.split()[1] == b"408", answer[:60]
    finally:
        for s in slow:
            s.close()


@pytest.mark.parametrize(
    ("path", "body"),
    [
        ("/v1/kv/pin", {"session_id": "s", "ttl_s": 1e308}),
        ("/v1/kv/pin", {"session_id": "s", "ttl_s": True}),
        ("/v1/kv/pin", {"session_id": "s", "ttl_s": 8 * 24 * 3600}),
        ("/v1/kv/pin", {"session_id": "", "ttl_s": 5}),
        ("/v1/kv/pin", {"session_id": "x" * 2000, "ttl_s": 5}),
        ("/v1/kv/prefetch", {"token_ids": [1, 2], "session_id": "s", "pin_ttl_s": 1e308}),
        ("/v1/kv/prefetch", {"token_ids": [1, 2**40]}),
        ("/v1/kv/prefetch", {"token_ids": [1, True]}),
    ],
)
def test_numbers_and_ids_are_validated(server: str, path: str, body: dict[str, Any]) -> None:
    """The control API accepted ``ttl_s`` 1e308 (a pin for good)."""
    r = call(server, "POST", path, **body)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["code"] == 400


def test_an_authenticated_connection_is_kept_alive_then_closed_when_idle(tight: ControlServer) -> None:
    with socket.create_connection(("127.0.0.1", tight.port), timeout=30) as s:
        for _ in range(2):  # two requests, one connection
            s.sendall(b"GET /v1/kv/stats HTTP/1.1\r\nHost: x\r\n" + AUTH + b"\r\n")
            head = b""
            while b"\r\n\r\n" not in head:
                head += s.recv(65536)
            assert head.startswith(b"HTTP/1.1 200") and b"connection: close" not in head.lower()
        assert tight.connections == 1
        rest = b""
        while part := s.recv(65536):  # b"" once the server closes the idle connection
            rest += part
    for _ in range(100):
        if tight.connections == 0:
            break
        time.sleep(0.02)
    assert tight.connections == 0 and tight.refused.get(408, 0) == 0  # closed quietly, no 408
