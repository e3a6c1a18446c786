"""SIGTERM drain on Anthropic's Messages API and OpenAI's Responses API, against real processes:
`agentgw serve` as a subprocess in front of a paced stand-in engine (testing/fake_engine.py
serves both routes, 50 ms between tokens), the harness of tests/gateway/test_drain.py.

With four streams in flight at SIGTERM (a short and a long one on each API): each short one
finishes inside the drain deadline with its API's own last event (``message_stop``;
``response.incomplete``) and no error; each long one is cut at the deadline with its API's error
event (``event: error`` in Anthropic's shape; ``response.failed``) and nothing after it; a
non-streamed Messages request its engine has not answered by then gets the drain's 503 in
Anthropic's shape; a request sent after SIGTERM gets a 503 with ``Retry-After`` in each API's
error shape (Anthropic's ``overloaded_error`` on ``/v1/messages``, OpenAI's ``shutting_down`` on
``/v1/responses``), or a refused connection once the listener is closed; the process exits 0.
Assertions are on events, never on durations."""

from __future__ import annotations

import json
import os
import signal
import threading
import time
from pathlib import Path
from typing import Any

import httpx

from gateway.local.engines import free_ports
from tests.conftest import fake_engine
from tests.gateway.test_drain import MODEL, SLOW_MODEL, _serve, _wait_engine_running, _wait_ready

SHORT, LONG = 20, 2000
"""Tokens of the stream that finishes inside the deadline, and of the one the deadline cuts."""


def _body(route: str, tokens: int, stream: bool, model: str = MODEL) -> dict[str, Any]:
    if route == "/v1/messages":
        msgs = [{"role": "user", "content": "hi"}]
        return {"model": model, "max_tokens": tokens, "messages": msgs, "stream": stream}
    return {"model": model, "input": "hi", "max_output_tokens": tokens, "stream": stream}


class TypedStream(threading.Thread):
    """One streamed request on a typed-event API; its ``(event, data)`` pairs as they arrive."""

    def __init__(self, url: str, route: str, tokens: int) -> None:
        super().__init__(daemon=True)
        self.url, self.route, self.tokens = url, route, tokens
        self.events: list[tuple[str, dict[str, Any]]] = []
        self.first = threading.Event()
        self.status: int | None = None
        self.error: BaseException | None = None

    def run(self) -> None:
        event = ""
        try:
            body = _body(self.route, self.tokens, stream=True)
            with httpx.stream("POST", self.url + self.route, json=body, timeout=120) as r:
                self.status = r.status_code
                for line in r.iter_lines():
                    if line.startswith("event: "):
                        event = line[len("event: ") :]
                    elif line.startswith("data: "):
                        self.events.append((event, json.loads(line[len("data: ") :])))
                        self.first.set()
        except httpx.HTTPError as exc:
            self.error = exc
        finally:
            self.first.set()

    def names(self) -> list[str]:
        return [e for e, _ in self.events]


class PendingMessage(threading.Thread):
    """A non-streamed Messages request whose engine has not answered when the deadline passes."""

    def __init__(self, url: str) -> None:
        super().__init__(daemon=True)
        self.url = url
        self.response: httpx.Response | None = None

    def run(self) -> None:
        body = _body("/v1/messages", 2, stream=False, model=SLOW_MODEL)
        self.response = httpx.post(self.url + "/v1/messages", json=body, timeout=120)


def test_sigterm_drain_on_messages_and_responses(tmp_path: Path) -> None:
    port = free_ports(1)[0]
    url = f"http://127.0.0.1:{port}"
    routes = ("/v1/messages", "/v1/responses")
    with (
        fake_engine("--model", MODEL, "--tokens", str(LONG), "--itl-ms", "50") as engine_url,
        fake_engine("--model", SLOW_MODEL, "--ttft-ms", "60000") as slow_url,
    ):
        proc = _serve(tmp_path, engine_url, slow_url, port, deadline_s=10)
        try:
            _wait_ready(proc, url)
            short = {r: TypedStream(url, r, SHORT) for r in routes}
            long = {r: TypedStream(url, r, LONG) for r in routes}
            pending = PendingMessage(url)
            for s in (*long.values(), *short.values()):
                s.start()
            pending.start()
            for s in (*long.values(), *short.values()):
                assert s.first.wait(60) and s.events, (s.route, s.status, s.error)
            _wait_engine_running(slow_url)
            proc.send_signal(signal.SIGTERM)

            # after the signal: new work on each API refused in its own shape
            late: dict[str, httpx.Response] = {}
            refused = False
            deadline = time.monotonic() + 30
            while len(late) < len(routes) and time.monotonic() < deadline and proc.poll() is None:
                try:
                    if httpx.get(url + "/ready", timeout=5).status_code == 503:
                        for route in routes:
                            body = _body(route, 4, stream=True)
                            late[route] = httpx.post(url + route, json=body, timeout=5)
                except httpx.ConnectError:
                    refused = True  # the listener is closed: an accepted answer too
                    break
                time.sleep(0.05)
            assert len(late) == len(routes) or refused

            for s in (*short.values(), *long.values()):
                s.join(120)
            pending.join(120)
            assert proc.wait(60) == 0
            out = proc.stdout.read().decode() if proc.stdout else ""
        finally:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)

    if "/v1/messages" in late:
        lm = late["/v1/messages"]
        assert lm.status_code == 503 and lm.headers["retry-after"], lm.text
        doc = lm.json()
        assert doc["type"] == "error" and doc["error"]["type"] == "overloaded_error", doc
        assert "shutting down" in doc["error"]["message"]
    if "/v1/responses" in late:
        lr = late["/v1/responses"]
        assert lr.status_code == 503 and lr.headers["retry-after"], lr.text
        assert lr.json()["error"]["code"] == "shutting_down", lr.text

    # the short streams finished inside the deadline: their API's last event, no error
    m, rs = short["/v1/messages"], short["/v1/responses"]
    assert m.error is None and m.status == 200, m.error
    assert m.names()[-1] == "message_stop" and "error" not in m.names(), out
    assert m.events[-2][1]["delta"]["stop_reason"] == "max_tokens"
    assert rs.error is None and rs.status == 200, rs.error
    assert rs.names()[-1] == "response.incomplete", rs.names()[-3:]
    assert "response.failed" not in rs.names()

    # the long ones were cut at the deadline: their API's error event last, no normal end before it
    m, rs = long["/v1/messages"], long["/v1/responses"]
    assert m.error is None and m.status == 200, m.error
    name, data = m.events[-1]
    assert name == "error" and data["type"] == "error", m.events[-3:]
    assert data["error"]["message"].startswith("the gateway is shutting down"), data
    assert "message_stop" not in m.names() and "message_delta" not in m.names()
    assert rs.error is None and rs.status == 200, rs.error
    name, data = rs.events[-1]
    assert name == "response.failed" and data["response"]["status"] == "failed", rs.events[-3:]
    assert data["response"]["error"]["message"].startswith("the gateway is shutting down"), data
    assert not {"response.completed", "response.incomplete"} & set(rs.names())

    # the Messages request its engine had not answered: the drain's 503, in Anthropic's shape
    assert pending.response is not None and pending.response.status_code == 503
    doc = pending.response.json()
    assert doc["type"] == "error" and doc["error"]["type"] == "overloaded_error", doc
    assert pending.response.headers["retry-after"]
    assert "2 request(s) finished, 3 cut at the deadline" in out, out
