"""A stand-in engine that records every POST it is sent: what reaches an engine (and its control
API, on the same loopback URL) through the gateway. Answers a chat completion for generation
routes, ``{}`` for ``/v1/kv/*`` and an empty model list for ``GET /v1/models``."""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

__all__ = ["Posted", "RecordingEngine"]

Posted = tuple[str, dict[str, str], dict[str, Any]]
"""(path, headers with lower-case names, JSON body) of one POST."""

_ANSWER = json.dumps(
    {
        "id": "chatcmpl-1",
        "object": "chat.completion",
        "model": "tiny-llama",
        "choices": [{"index": 0, "message": {"role": "assistant", "content": "ok"}, "finish_reason": "stop"}],
        "usage": {"prompt_tokens": 5, "completion_tokens": 1, "total_tokens": 6},
    }
).encode()


class RecordingEngine:
    def __init__(self) -> None:
        self.seen: list[Posted] = []
        recorder = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, format: str, *args: Any) -> None:
                return

            def _send(self, body: bytes) -> None:
                self.send_response(200)
                self.send_header("content-type", "application/json")
                self.send_header("content-length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def do_GET(self) -> None:
                self._send(b'{"object": "list", "data": []}' if self.path == "/v1/models" else b"")

            def do_POST(self) -> None:
                raw = self.rfile.read(int(self.headers.get("content-length") or 0))
                headers = {k.lower(): v for k, v in self.headers.items()}
                recorder.seen.append((self.path, headers, json.loads(raw)))
                self._send(b"{}" if self.path.startswith("/v1/kv/") else _ANSWER)

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()

    def turns(self) -> list[dict[str, Any]]:
        """The bodies of the chat completions it was sent."""
        return [body for path, _, body in self.seen if path == "/v1/chat/completions"]

    def control_calls(self) -> list[str]:
        """The paths of the control-API calls it was sent."""
        return [path for path, _, _ in self.seen if path.startswith("/v1/kv/")]
