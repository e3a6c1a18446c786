"""Control API for the gateway: a small HTTP side server inside the engine's scheduler process.

Why a side server: vLLM 0.32's `vllm.endpoint_plugins` add routes to the API-server process,
but the offload state (host-tier index, pins, tier counters) lives in the EngineCore process,
and the API server has no channel to a connector's scheduler half. The spec starts this server
next to the state it serves when `control_port` is set in kv_connector_extra_config.

Endpoints (JSON; every call needs `Authorization: Bearer <control_token>`):
    GET  /v1/kv/stats                     per-tier bytes, hits, duplicates skipped, latency;
                                          `device`: device pins (pinned blocks, pinned_share)
    GET  /metrics                         the device-pin gauges and counters, Prometheus text
    GET  /v1/kv/sessions/{session_id}     host chunks held for the session, its pins
    POST /v1/kv/pin    {"session_id", "ttl_s"}   (idempotent: re-pinning resets the TTL)
    POST /v1/kv/unpin  {"session_id"}            (idempotent)
    POST /v1/kv/evict  {"session_id"}            drop the pins; the session's host chunks go first
    POST /v1/kv/prefetch {"token_ids", "session_id"?, "pin_ttl_s"?}
        load a token prefix's KV (host tier or Mooncake) into this engine's device cache and
        host tier ahead of the request: it runs a 1-token completion of the prefix through the
        engine's own serving path (`engine_url`), so loads use vLLM's normal connector path;
        answers prompt_tokens and cached_tokens. Idempotent (a repeat is a local cache hit).
Concurrency is bounded (`control_max_inflight`, default 8): past it the server answers 429.

Device pins (engine_ext.scheduler): the pinning scheduler attaches its `DevicePins` to the
service started on the same `control_port` (`service_on`: vLLM builds the connector's spec and
the scheduler separately, by name, and hands neither to the other, so this per-process table
keyed by port is their one link). Pin, unpin and evict then also queue a device command, which
the scheduler applies on the engine-core thread at its next step; the answer says `queued`.
"""

from __future__ import annotations

import hmac
import json
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from engine_ext.device_pins import DevicePins, PinCommand

__all__ = ["ControlServer", "ControlService", "register_service", "service_on"]

_SERVICES: dict[int, ControlService] = {}  # control_port -> the service of this process


def register_service(port: int, service: ControlService) -> None:
    _SERVICES[port] = service


def service_on(port: int) -> ControlService | None:
    return _SERVICES.get(port)


class ControlService:
    """The operations, independent of HTTP. `stats` is a callable returning a JSON-able dict."""

    def __init__(self, policy: Any, stats: Callable[[], dict[str, Any]], engine_url: str | None = None):
        self._policy = policy
        self._stats = stats
        self._engine_url = engine_url.rstrip("/") if engine_url else None
        self._model: str | None = None
        self._device: DevicePins | None = None
        self._clock: Callable[[], float] = time.monotonic

    def attach_device(self, pins: DevicePins, clock: Callable[[], float]) -> None:
        """Serve the scheduler's device pins too (called once, from the scheduler's __init__)."""
        self._device, self._clock = pins, clock

    def _queue(self, command: PinCommand) -> dict[str, Any] | None:
        if self._device is None:
            return None
        return {
            "queued": self._device.submit(command),
            "known_blocks": self._device.known_blocks(command.session_id),
        }

    def stats(self) -> dict[str, Any]:
        out = self._stats()
        out["device"] = None if self._device is None else self._device.snapshot(self._clock)
        return out

    def metrics(self) -> str:
        """Prometheus text for the device pins (empty when the engine has no pinning scheduler)."""
        if self._device is None:
            return ""
        snap = self._device.snapshot()
        lines = []
        for name, key, kind in (
            ("agentgw_kv_device_pinned_blocks", "pinned_blocks", "gauge"),
            ("agentgw_kv_device_pinned_sessions", "pinned_sessions", "gauge"),
            ("agentgw_kv_device_pinned_share", "pinned_share", "gauge"),
            ("agentgw_kv_device_pin_bound_blocks", "max_pinned_blocks", "gauge"),
        ):
            lines += [f"# TYPE {name} {kind}", f"{name} {snap[key]}"]
        name = "agentgw_kv_device_pin_releases_total"
        lines.append(f"# TYPE {name} counter")
        for reason in ("expired", "released", "yielded_to_bound", "released_for_admission", "reset"):
            lines.append(f'{name}{{reason="{reason}"}} {snap[reason]}')
        for key in ("pinned", "refused_over_bound"):
            lines += [
                f"# TYPE agentgw_kv_device_{key}_total counter",
                f"agentgw_kv_device_{key}_total {snap[key]}",
            ]
        return "\n".join(lines) + "\n"

    def session(self, session_id: str) -> dict[str, Any]:
        out = {"session_id": session_id, **self._policy.session_state(session_id)}
        if self._device is not None:
            out["device_pin"] = self._device.session(session_id, self._clock())
        return out

    def pin(self, session_id: str, ttl_s: float) -> dict[str, Any]:
        n = self._policy.pin_session(session_id, ttl_s)
        device = self._queue(PinCommand(session_id, until=self._clock() + ttl_s))
        return {"session_id": session_id, "pinned_chunks": n, "ttl_s": ttl_s, "device": device}

    def unpin(self, session_id: str) -> dict[str, Any]:
        unpinned = self._policy.unpin_session(session_id)
        return {"session_id": session_id, "unpinned": unpinned, "device": self._queue(PinCommand(session_id))}

    def evict(self, session_id: str) -> dict[str, Any]:
        demoted = self._policy.demote_session(session_id)
        device = self._queue(PinCommand(session_id, end=True))
        return {"session_id": session_id, "demoted_chunks": demoted, "device": device}

    def _post(self, path: str, body: dict[str, Any] | None = None) -> dict[str, Any]:
        assert self._engine_url is not None
        data = None if body is None else json.dumps(body).encode()
        request = urllib.request.Request(
            self._engine_url + path, data=data, headers={"Content-Type": "application/json"}
        )
        with urllib.request.urlopen(request, timeout=600) as response:
            return json.loads(response.read())

    def prefetch(self, token_ids: list[int], hint: dict[str, Any] | None) -> dict[str, Any]:
        if self._engine_url is None:
            raise LookupError("prefetch needs engine_url in kv_connector_extra_config")
        if self._model is None:
            self._model = self._post("/v1/models")["data"][0]["id"]
        body: dict[str, Any] = {"model": self._model, "prompt": token_ids, "max_tokens": 1, "temperature": 0}
        if hint:
            body["kv_transfer_params"] = {"agentgw": hint}
        usage = self._post("/v1/completions", body).get("usage") or {}
        details = usage.get("prompt_tokens_details") or {}
        return {"prompt_tokens": usage.get("prompt_tokens"), "cached_tokens": details.get("cached_tokens")}


def _error(status: int, message: str, kind: str) -> tuple[int, dict[str, Any]]:
    return status, {"error": {"message": message, "type": kind, "code": status}}


class ControlServer:
    def __init__(self, service: ControlService, host: str, port: int, token: str, max_inflight: int = 8):
        if not token or token != token.strip():
            # an empty token matched a bare "Authorization: Bearer": the API was open
            raise ValueError("control_token must be set (non-empty, no surrounding spaces)")
        self.service = service
        self._token = token.encode()
        self._slots = threading.BoundedSemaphore(max_inflight)
        server = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, format: str, *args: Any) -> None:
                return

            def _reply(self, status: int, body: dict[str, Any] | str) -> None:
                if isinstance(body, str):
                    data, kind = body.encode(), "text/plain; version=0.0.4"
                else:
                    data, kind = json.dumps(body).encode(), "application/json"
                self.send_response(status)
                self.send_header("Content-Type", kind)
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def _handle(self, method: str) -> None:
                if not server._slots.acquire(blocking=False):
                    self._reply(*_error(429, "too many control requests in flight", "rate_limited"))
                    return
                try:
                    self._reply(
                        *server.dispatch(method, self.path, self.headers.get("Authorization", ""), self)
                    )
                finally:
                    server._slots.release()

            def do_GET(self) -> None:
                self._handle("GET")

            def do_POST(self) -> None:
                self._handle("POST")

        self._httpd = ThreadingHTTPServer((host, port), Handler)
        self._httpd.daemon_threads = True
        self.port = self._httpd.server_address[1]
        self._thread = threading.Thread(target=self._httpd.serve_forever, name="agentgw_control", daemon=True)
        self._configured_port = port

    def start(self) -> None:
        register_service(self._configured_port, self.service)
        self._thread.start()

    def stop(self) -> None:
        if _SERVICES.get(self._configured_port) is self.service:
            del _SERVICES[self._configured_port]
        self._httpd.shutdown()
        self._httpd.server_close()

    def dispatch(
        self, method: str, path: str, auth: str, handler: BaseHTTPRequestHandler
    ) -> tuple[int, dict[str, Any] | str]:
        scheme, _, token = auth.partition(" ")
        if scheme.lower() != "bearer" or not token or not hmac.compare_digest(token.encode(), self._token):
            return _error(401, "missing or invalid bearer token", "unauthorized")
        body: dict[str, Any] = {}
        if method == "POST":
            length = int(handler.headers.get("Content-Length") or 0)
            if length > 65536:
                return _error(413, "body too large", "invalid_request_error")
            try:
                body = json.loads(handler.rfile.read(length) or b"{}")
            except json.JSONDecodeError as exc:
                return _error(400, f"invalid JSON: {exc}", "invalid_request_error")
            if not isinstance(body, dict):
                return _error(400, "body must be a JSON object", "invalid_request_error")
        svc = self.service
        if method == "GET" and path == "/v1/kv/stats":
            return 200, svc.stats()
        if method == "GET" and path == "/metrics":
            return 200, svc.metrics()
        if method == "GET" and path.startswith("/v1/kv/sessions/"):
            return 200, svc.session(path.removeprefix("/v1/kv/sessions/"))
        if method == "POST" and path == "/v1/kv/prefetch":
            ids = body.get("token_ids")
            if not isinstance(ids, list) or not ids or not all(isinstance(t, int) and t >= 0 for t in ids):
                return _error(
                    400, "token_ids (non-empty list of token ids) is required", "invalid_request_error"
                )
            hint = {k: body[k] for k in ("session_id", "pin_ttl_s") if k in body} or None
            if hint is not None and "session_id" not in hint:
                return _error(400, "pin_ttl_s needs session_id", "invalid_request_error")
            try:
                return 200, svc.prefetch(ids, hint)
            except LookupError as exc:
                return _error(501, str(exc), "not_configured")
            except (urllib.error.URLError, OSError, ValueError) as exc:
                return _error(502, f"prefetch through the engine failed: {exc}", "engine_error")
        if method == "POST" and path in ("/v1/kv/pin", "/v1/kv/unpin", "/v1/kv/evict"):
            session_id = body.get("session_id")
            if not isinstance(session_id, str) or not session_id:
                return _error(400, "session_id (string) is required", "invalid_request_error")
            if path == "/v1/kv/pin":
                ttl = body.get("ttl_s")
                if not isinstance(ttl, int | float) or ttl <= 0:
                    return _error(400, "ttl_s (positive number) is required", "invalid_request_error")
                return 200, svc.pin(session_id, float(ttl))
            if path == "/v1/kv/evict":
                return 200, svc.evict(session_id)
            return 200, svc.unpin(session_id)
        return _error(404, f"no route {method} {path}", "not_found")
