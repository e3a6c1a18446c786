"""The control server over a real loopback socket, with an in-memory policy standing in."""

from __future__ import annotations

import socket
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from engine_ext.config import kv_transfer_config
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
        kv_transfer_config(1 << 20, control_port=1, control_token=token or None)


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
