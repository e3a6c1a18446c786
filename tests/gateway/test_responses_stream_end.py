"""A client that leaves once the stream's last event has reached it got its whole answer: Codex
drops the connection at ``response.completed``, before the engine closes the stream. The relay
counts that request 200 and settles the turn as served (it was a 499, and a failed turn, found
by the harnesses-doc test: "/v1/responses 2xx count 4 < 5" with one 499); a client that leaves
before the last event is still a 499.

The upstream is a stand-in engine in this module that sends ``response.created``, then
``response.completed``, then holds the stream open (as an engine may while it finishes); the
gateway's ASGI app is driven directly on the served gateway's loop so the disconnect comes
exactly after the chosen event."""

from __future__ import annotations

import asyncio
import re
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import httpx
import orjson
import pytest

from tests.conftest import ServedGateway, wait_ready

HOLD_S = 3.0
CREATED = b'event: response.created\ndata: {"type":"response.created","response":{"id":"resp_se1"}}\n\n'
COMPLETED = b'event: response.completed\ndata: {"type":"response.completed","response":{"id":"resp_se1"}}\n\n'


class _Engine(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def log_message(self, *args: object) -> None:
        pass

    def do_GET(self) -> None:
        body = b"ok"
        self.send_response(200)
        self.send_header("content-length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def do_POST(self) -> None:
        early = b"early" in self.rfile.read(int(self.headers.get("content-length", 0)))
        self.send_response(200)
        self.send_header("content-type", "text/event-stream")
        self.send_header("transfer-encoding", "chunked")
        self.end_headers()
        try:
            for event in (CREATED, COMPLETED):
                self.wfile.write(b"%x\r\n%s\r\n" % (len(event), event))
                self.wfile.flush()
                # "early": a pause before the last event (the client leaves mid-answer); else
                # after it: the last event is out, the stream is not closed yet
                if early == (event is CREATED):
                    time.sleep(HOLD_S)
            self.wfile.write(b"0\r\n\r\n")
            self.wfile.flush()
        except OSError:
            pass


@pytest.fixture(scope="module")
def holding_engine() -> Iterator[str]:
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Engine)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()


def _statuses(url: str) -> dict[str, float]:
    text = httpx.get(url + "/metrics", timeout=10).text
    out: dict[str, float] = {}
    for labels, value in re.findall(r"^agentgw_requests_total\{([^}]*)\} ([0-9.e+]+)$", text, re.M):
        fields = dict(re.findall(r'(\w+)="([^"]*)"', labels))
        if fields.get("route") == "/v1/responses":
            out[fields["status"]] = out.get(fields["status"], 0.0) + float(value)
    return out


def _leave_after(gw: ServedGateway, marker: bytes, text: str = "go") -> list[bytes]:
    body = orjson.dumps({"model": "m", "input": text, "stream": True, "store": False})
    scope = {
        "type": "http",
        "asgi": {"version": "3.0", "spec_version": "2.4"},
        "http_version": "1.1",
        "method": "POST",
        "path": "/v1/responses",
        "headers": [(b"content-type", b"application/json")],
    }

    async def drive() -> list[bytes]:
        inbox: asyncio.Queue[dict] = asyncio.Queue()
        inbox.put_nowait({"type": "http.request", "body": body, "more_body": False})
        got: list[bytes] = []

        async def send(message: dict) -> None:
            chunk = message.get("body", b"")
            if chunk:
                got.append(chunk)
                if marker in chunk:
                    inbox.put_nowait({"type": "http.disconnect"})  # the client leaves here

        await asyncio.wait_for(gw.app(scope, inbox.get, send), 30)
        return got

    assert gw.loop is not None
    return asyncio.run_coroutine_threadsafe(drive(), gw.loop).result(40)


def test_leaving_after_the_last_event_is_a_served_request(holding_engine: str) -> None:
    cfg = {
        "pools": [
            {"name": "p", "role": "any", "engines": [{"name": "e", "url": holding_engine, "model": "m"}]}
        ]
    }
    with ServedGateway(cfg) as gw:
        wait_ready(gw.url)
        got = _leave_after(gw, b"response.completed")
        assert any(COMPLETED in c for c in got)
        assert _statuses(gw.url) == {"200": 1.0}
        got = _leave_after(gw, b"response.created", "early")  # left mid-answer: a 499, as before
        assert not any(COMPLETED in c for c in got)
        assert _statuses(gw.url) == {"200": 1.0, "499": 1.0}
        metrics = httpx.get(gw.url + "/metrics", timeout=10).text
        assert 'agentgw_client_disconnects_total{engine="e"} 1.0' in metrics
