"""A loopback HTTP proxy that relays every request to one target over httpx, for benchmarks and
tests that watch what a real client sends and gets (harnesses, SDKs).

`LoopbackProxy` owns the threaded HTTP/1.1 server on 127.0.0.1 (an ephemeral port, `url`), reads
each request, drops hop-by-hop headers and calls `handle`. The default `handle` relays the answer
whole once the target's stream ends (clients read SSE either way); a subclass overrides `handle`
to record or rewrite the exchange and answers with `send_whole` or `send_streamed`.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import httpx

HOP_HEADERS = frozenset(
    {"connection", "keep-alive", "transfer-encoding", "content-length", "content-encoding", "host"}
)


class LoopbackProxy:
    def __init__(self, target: str, timeout: float | httpx.Timeout) -> None:
        self.target = target
        self._http = httpx.Client(base_url=target, timeout=timeout)
        proxy = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def _relay(self) -> None:
                n = int(self.headers.get("content-length") or 0)
                body = self.rfile.read(n) if n else b""
                headers = {k: v for k, v in self.headers.items() if k.lower() not in HOP_HEADERS}
                proxy.handle(self, self.command, self.path, headers, body)

            do_GET = do_POST = do_DELETE = _relay

            def log_message(self, format: str, *args: Any) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self._thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self._thread.start()

    def handle(
        self, client: BaseHTTPRequestHandler, method: str, path: str, headers: dict[str, str], body: bytes
    ) -> None:
        self.send_whole(client, self._http.request(method, path, headers=headers, content=body))

    @staticmethod
    def send_whole(client: BaseHTTPRequestHandler, up: httpx.Response) -> None:
        """Answer with the target's whole (already read) response."""
        client.send_response(up.status_code)
        for k, v in up.headers.items():
            if k.lower() not in HOP_HEADERS:
                client.send_header(k, v)
        client.send_header("content-length", str(len(up.content)))
        client.end_headers()
        client.wfile.write(up.content)

    @staticmethod
    def send_streamed(
        client: BaseHTTPRequestHandler, up: httpx.Response, on_chunk: Callable[[bytes], None] | None = None
    ) -> None:
        """Answer chunk by chunk as the target's open stream (`httpx.Client.stream`) delivers,
        calling `on_chunk` before each chunk is passed on."""
        client.send_response(up.status_code)
        for k, v in up.headers.items():
            if k.lower() not in HOP_HEADERS:
                client.send_header(k, v)
        client.send_header("transfer-encoding", "chunked")
        client.end_headers()
        for chunk in up.iter_raw():
            if on_chunk is not None:
                on_chunk(chunk)
            client.wfile.write(f"{len(chunk):x}\r\n".encode() + chunk + b"\r\n")
            client.wfile.flush()
        client.wfile.write(b"0\r\n\r\n")

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()
        self._http.close()
